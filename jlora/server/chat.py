"""Chat prompts: a model's `chat_template` (tokenizer_config.json) rendered with jinja2 as transformers
renders it (a sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`, the special
tokens as variables, `add_generation_prompt`)."""

from __future__ import annotations

import os

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jlora.models.loading import read_json_object

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, bad messages, or the template refused them)."""


def _raise(message: str):
    raise TemplateError(message)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """The chat template of a model directory (None-safe: `render` raises when the model has none)."""

    def __init__(self, model_dir: str):
        """Raises ValueError, naming the file, when tokenizer_config.json is not a JSON object or its
        chat_template is not a template that compiles."""
        path = os.path.join(model_dir, "tokenizer_config.json")
        config = {}
        if os.path.isfile(path):
            config = read_json_object(path)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{path}: chat_template must be a string or a list of named templates")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = template or None  # the template's text (/tokenizer_info)
        try:
            self.template = env.from_string(template) if template else None
        except TemplateError as err:
            raise ValueError(f"{path}: chat_template does not compile ({err})") from None
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                            "pad_token")}

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` ([{"role", "content"}]), ending with the assistant's turn."""
        if self.template is None:
            raise ChatTemplateError("the model has no chat_template in tokenizer_config.json; use /v1/completions")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with string 'role' and 'content'")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
