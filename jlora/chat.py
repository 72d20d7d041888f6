"""Chat prompts: a model's chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`, as
transformers looks for it) rendered with jinja2 as transformers renders it: a sandboxed environment with
trim_blocks and lstrip_blocks, loop controls and the `{% generation %}` tag, its `tojson` (no HTML escaping,
keys in order), `raise_exception` and `strftime_now`, the special tokens as variables, `tools` and `documents`
none, `add_generation_prompt`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jlora.models.loading import read_json_object

__all__ = ["ChatOptions", "ChatTemplate", "ChatTemplateError"]


_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker: the same text cuts the same way


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How messages are rendered (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, bad messages, or the template refused them)."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's text with it): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def text_content(message, index: int) -> dict:
    """`message` ({"role", "content"}) with its content one string: a list of OpenAI's text parts ({"type": "text",
    "text": ...}) is joined by newlines, as vLLM joins them (the chat templates take a string). Raises
    ChatTemplateError naming the message or part that is neither."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (str, list)) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"messages[{index}] must be an object with a string 'role' and a 'content' that is "
                                "a string or a list of text parts")
    if isinstance(content, str):
        return message
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ChatTemplateError(f"messages[{index}].content[{j}] is a {kind!r} part: only text parts "
                                    "({'type': 'text', 'text': ...}) are supported")
        if "text" not in part:
            raise ChatTemplateError(f"messages[{index}].content[{j}] is a text part without 'text'")
        if not isinstance(part["text"], str):
            raise ChatTemplateError(f"messages[{index}].content[{j}] has a 'text' that is not a string")
    return {**message, "content": "\n".join(part["text"] for part in content)}


class ChatTemplate:
    """The chat template of a model directory (None-safe: `render` raises when the model has none)."""

    def __init__(self, model_dir: str | None = None):
        """The template of `model_dir` (None: none). Raises ValueError, naming the file, when
        tokenizer_config.json is not a JSON object, chat_template.jinja is not UTF-8 text, or the template is not
        one that compiles."""
        path = os.path.join(model_dir or "", "tokenizer_config.json")
        config = {}
        if model_dir is not None and os.path.isfile(path):
            config = read_json_object(path)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{path}: chat_template must be a string or a list of named templates")
        jinja = os.path.join(model_dir or "", "chat_template.jinja")  # what transformers saves now; it comes first
        if model_dir is not None and os.path.isfile(jinja):
            path = jinja
            try:
                with open(jinja, encoding="utf-8") as f:
                    template = f.read()
            except UnicodeDecodeError as err:
                raise ValueError(f"{jinja}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.source = template or None  # the template's text (/tokenizer_info)
        try:
            self.template = env.from_string(template) if template else None
        except TemplateError as err:
            raise ValueError(f"{path}: the chat template does not compile ({err})") from None
        self.special = {name: _token_text(config.get(name)) for name in (
            "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}

    def render(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> str:
        """The prompt text of `messages` ([{"role", "content"}], content a string or text parts: `text_content`):
        with `add_generation_prompt`, ending with the assistant's turn; with `continue_final_message`, ending
        inside the last message, cut where its text ends (as transformers cuts it); `chat_template_kwargs` are the
        template's variables beside these."""
        if self.template is None:
            raise ChatTemplateError("the model has no chat template (chat_template.jinja, or chat_template in "
                                    "tokenizer_config.json); give the prompt as text instead")
        messages = [text_content(m, i) for i, m in enumerate(messages)]
        if options.add_generation_prompt and options.continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        reserved = sorted({"messages", "tools", "documents", "add_generation_prompt"}
                          & set(options.chat_template_kwargs))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
        final = messages[-1]["content"] if messages else ""
        if options.continue_final_message:  # a marker after the final text shows where the template put it
            if not messages:
                raise ChatTemplateError("continue_final_message needs a message to continue")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE}]
        try:
            text = self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=options.add_generation_prompt,
                                        **{**self.special, **options.chat_template_kwargs})
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
        except Exception as err:  # the request's values where the template wants others ({{ x + 1 }} of a string)
            raise ChatTemplateError(f"the chat template failed on the request's values: {type(err).__name__}: "
                                    f"{str(err)[:200]}") from None
        if not options.continue_final_message:
            return text
        if final.strip() not in text or _CONTINUE.strip() not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not keep the final message's "
                                    "text, so there is nothing to continue")
        at = text.rindex(_CONTINUE.strip())
        return text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()  # trimmed spacing: trim it too
