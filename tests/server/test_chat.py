"""Chat templates rendered as transformers renders them: where it finds the template, and the environment it
gives it. Where transformers is installed (the GPU machine), its `apply_chat_template` is the truth."""

import datetime
import json

import pytest

pytest.importorskip("jinja2")

from jlora import testing  # noqa: E402
from jlora.server.chat import ChatTemplate, ChatTemplateError  # noqa: E402

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
    for messages in (MESSAGES, MESSAGES[:2]):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ChatTemplate(path).render(messages) == want
