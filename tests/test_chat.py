"""Chat templates rendered as transformers renders them: where it finds the template, and the environment it
gives it. Where transformers is installed (the GPU machine), its `apply_chat_template` is the truth."""

import datetime
import json

import pytest

pytest.importorskip("jinja2")

from jlora import testing  # noqa: E402
from jlora.chat import ChatOptions, ChatTemplate, ChatTemplateError  # noqa: E402

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the <quick> fox: café"},
            {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over"}]
# What real templates use beside plain loops: loop controls (break), the {% generation %} tag, tojson, today's
# date, `tools is defined` (transformers passes tools=None), the special tokens, raise_exception.
TEMPLATES = {
    "tojson and generation": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m | tojson }}{% endif %}|{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"),
    "break and the date": (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}today {{ strftime_now('%d %b %Y') }}{{ eos_token }}"),
    "options": (  # continue_final_message cuts where the last message ends, before its end-of-turn
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}"),
    "tools defined as none": (
        "{% if tools is defined and tools is none %}no tools{% endif %}"
        "{% if documents is defined and documents is none %}, no documents{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson(indent=2) }}{% endfor %}"),
}


def _model(tmp_path, template: str, *, jinja: bool):
    tmp_path.mkdir(exist_ok=True)
    testing.write_tokenizer(str(tmp_path), 40, chat_template=None if jinja else template)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.exists() else {}), **config}))
    if jinja:
        (tmp_path / "chat_template.jinja").write_text(template)
    return str(tmp_path)


@pytest.mark.parametrize("jinja", [True, False])
def test_the_environment_is_transformers(tmp_path, jinja):
    chat = ChatTemplate(_model(tmp_path / "a", TEMPLATES["tojson and generation"], jinja=jinja))
    text = chat.render(MESSAGES)
    assert text.startswith('<s>{"role": "system", "content": "be brief"}|')  # no HTML escaping, keys in order
    assert '"the <quick> fox: café"' in text and "|jumps|" in text and text.endswith("|<assistant>")
    chat = ChatTemplate(_model(tmp_path / "b", TEMPLATES["break and the date"], jinja=jinja))
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert chat.render(MESSAGES) == f"system: be brief\nuser: the <quick> fox: café\ntoday {today}</s>"
    chat = ChatTemplate(_model(tmp_path / "c", TEMPLATES["tools defined as none"], jinja=jinja))
    assert chat.render(MESSAGES[:1]) == 'no tools, no documents[system]"be brief"'


# (options, transformers' apply_chat_template keywords): the same rendering asked each way
OPTIONS = [(ChatOptions(), {}), (ChatOptions(add_generation_prompt=False), {"add_generation_prompt": False}),
           (ChatOptions(False, True), {"add_generation_prompt": False, "continue_final_message": True}),
           (ChatOptions(chat_template_kwargs={"enable_thinking": True}), {"enable_thinking": True})]


def test_the_options(tmp_path):
    chat = ChatTemplate(_model(tmp_path, TEMPLATES["options"], jinja=True))
    turns = "<system>be brief</system>\n<user>the <quick> fox: café</user>\n<assistant>jumps</assistant>\n"
    assert chat.render(MESSAGES[:3], OPTIONS[0][0]) == turns + "<assistant>"
    assert chat.render(MESSAGES[:3], OPTIONS[1][0]) == turns
    assert chat.render(MESSAGES[:3], OPTIONS[2][0]) == turns[:-len("</assistant>\n")]
    assert chat.render(MESSAGES[:3], OPTIONS[3][0]) == turns + "<assistant><think>"
    for options, message in ((ChatOptions(True, True), "cannot both be true"),
                             (ChatOptions(chat_template_kwargs={"messages": []}), "cannot set messages"),
                             (ChatOptions(chat_template_kwargs={"enable_thinking": {"a": 1}}), None)):
        if message is None:  # a dict where a boolean goes renders as the template makes it
            chat.render(MESSAGES, options)
            continue
        with pytest.raises(ChatTemplateError, match=message):
            chat.render(MESSAGES, options)
    dropped = ChatTemplate(_model(tmp_path / "d", "{% for m in messages %}{{ m.role }}{% endfor %}", jinja=True))
    with pytest.raises(ChatTemplateError, match="does not keep the final message's text"):
        dropped.render(MESSAGES, OPTIONS[2][0])
    failing = ChatTemplate(_model(tmp_path / "f", "{{ enable_thinking + 1 }}", jinja=True))
    with pytest.raises(ChatTemplateError, match="failed on the request's values: TypeError"):
        failing.render(MESSAGES, ChatOptions(chat_template_kwargs={"enable_thinking": "yes"}))


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    path = _model(tmp_path, "{{ 'from the config' }}", jinja=False)
    (tmp_path / "chat_template.jinja").write_text("{{ 'from the file' }}")
    assert ChatTemplate(path).render(MESSAGES) == "from the file"
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(ValueError, match="chat_template.jinja: not UTF-8 text"):
        ChatTemplate(path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat_template.jinja: the chat template does not compile"):
        ChatTemplate(path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system messages') }}")
    with pytest.raises(ChatTemplateError, match="the chat template refused the messages: no system messages"):
        ChatTemplate(path).render(MESSAGES)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("jinja", [True, False])
def test_renders_what_transformers_renders(tmp_path, name, jinja):
    transformers = pytest.importorskip("transformers")
    path = _model(tmp_path, TEMPLATES[name], jinja=jinja)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for messages in (MESSAGES, MESSAGES[:2], MESSAGES[:3]):
        for options, keywords in OPTIONS:
            try:
                want = hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **keywords})
            except ValueError:  # a template that drops the final message: nothing to continue, in both
                with pytest.raises(ChatTemplateError, match="nothing to continue"):
                    ChatTemplate(path).render(messages, options)
                continue
            assert ChatTemplate(path).render(messages, options) == want, (messages, options)


def test_engine_chat_generates_from_the_rendered_conversation(tmp_path):
    """`Engine.chat` is `generate` on the template's rendering, tokenized without added special tokens (the
    template has them); errors name the conversation."""
    from jlora.engine import Engine

    cfg = testing.tiny_config("llama", vocab_size=40)
    testing.write_model(str(tmp_path / "m"), cfg, seed=2)
    testing.write_tokenizer(str(tmp_path / "m"), 40)  # the test template: "ROLE CONTENT " per message
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="float32", max_seq_len=32, progress=False)
    conversations = [[{"role": "user", "content": "the lazy dog"}],
                     [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps over"}]]
    texts = ["user the lazy dog assistant", "user the fox assistant jumps over"]
    want = engine.generate([engine.tokenizer.encode(t).ids for t in texts], [None, None], max_new_tokens=3,
                           temperature=1.0, seed=4)
    got = engine.chat(conversations[:1], [None], max_new_tokens=3, temperature=1.0, seed=4)
    assert list(got[0]) == list(want[0])
    cont = engine.chat(conversations[1:], [None], 3, ChatOptions(False, True), temperature=1.0, seed=5)
    assert list(cont[0]) == list(engine.generate([engine.tokenizer.encode(texts[1]).ids], [None], 3,
                                                 temperature=1.0, seed=5)[0])
    parts = [{"type": "text", "text": "the lazy"}, {"type": "text", "text": "dog"}]  # OpenAI's: joined by newlines
    assert list(engine.chat([[{"role": "user", "content": parts}]], [None], max_new_tokens=3, temperature=1.0,
                            seed=4)[0]) == list(want[0])  # "the lazy\ndog" tokenizes as "the lazy dog" here
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for bad, message in (([[{"role": "user"}]], "conversation 0: messages\\[0\\] must be an object"),
                         ([[{"role": "user", "content": [parts[0], image]}]],
                          r"conversation 0: messages\[0\].content\[1\] is a 'image_url' part: only text parts"),
                         ([[{"role": "user", "content": ["the"]}]], r"content\[0\] is a 'str' part"),
                         ([[{"role": "user", "content": [{"type": "text"}]}]], "is a text part without 'text'"),
                         ([[{"role": "user", "content": [{"type": "text", "text": 3}]}]],
                          "has a 'text' that is not a string"),
                         ([[]], "conversation 0 must be a non-empty list of messages"),
                         ("hi", "conversations must be a list of conversations")):
        with pytest.raises(ValueError, match=message):
            engine.chat(bad, [None], 3)
    testing.write_model(str(tmp_path / "bare"), cfg, seed=2)
    testing.write_tokenizer(str(tmp_path / "bare"), 40, chat_template=None)
    bare = Engine.from_pretrained(str(tmp_path / "bare"), dtype="float32", max_seq_len=32, progress=False)
    with pytest.raises(ValueError, match="conversation 0: the model has no chat template"):
        bare.chat(conversations[:1], [None], 3)
