"""`adapter_config.json` as untrusted input: read with bounded size and nesting, every field PEFT's LoRA math
reads checked for type and range, and adapter names checked before anything is registered.

Errors name the field and what it must be, never the value found there (a caller of a runtime load must not
read a server file's contents back from an error).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence

from jlora.values import is_integer, is_real

__all__ = ["MAX_ALPHA", "MAX_CONFIG_BYTES", "AdapterError", "adapter_file", "check_adapter_name",
           "OutsideRootsError", "check_start_adapters", "read_config", "within"]

MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1 KB; a megabyte holds any real target list
MAX_ALPHA = 2.0**16  # |lora_alpha| (and alpha_pattern's values) beyond this is refused: no real adapter uses it
_MAX_PATTERN = 1024  # characters of a target_modules / rank_pattern / alpha_pattern regular expression
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:@+]{0,127}")
_UNSUPPORTED = {  # config key: (value that is fine, what to say)
    "bias": ("none", "trained biases of the base layers (bias != 'none')"),
    "layer_replication": (None, "layer_replication"),
    "use_qalora": (False, "QALoRA (use_qalora=True)"),
    "target_parameters": (None, "target_parameters (LoRA on raw parameters)"),
    # PEFT's LoRA variants whose forward differs from LoRA's (VeLoRA changes only the backward pass: taken)
    "alora_invocation_tokens": (None, "Activated LoRA (alora_invocation_tokens)"),
    "use_bdlora": (None, "BD-LoRA (use_bdlora)"),
    "arrow_config": (None, "Arrow routing (arrow_config)"),
    "kasa_config": (None, "KaSA (kasa_config)"),
    "monteclora_config": (None, "MonteCLoRA (monteclora_config)"),
}


class AdapterError(ValueError):
    """A PEFT adapter that cannot be loaded; the message names the adapter path and the problem."""


class OutsideRootsError(AdapterError):
    """An adapter file that resolves outside the directories adapters may be loaded from (`adapter_file`)."""


def adapter_file(adapter_dir: str, name: str, roots: Sequence[str] = ()) -> str:
    """The path of file `name` in `adapter_dir`, which must be a regular file (after links): a directory, device
    or pipe in its place is refused before anything opens it. With `roots` (real paths: a runtime load's
    --lora-root) the file must resolve inside one of them, links included: a link in an adapter directory to a
    file elsewhere is refused, without naming where it leads."""
    path = os.path.join(adapter_dir, name)
    if not os.path.isfile(path):
        raise AdapterError(f"{adapter_dir}: {name} {'is not a regular file' if os.path.exists(path) else 'not found'}")
    if roots and not any(within(os.path.realpath(path), root) for root in roots):
        raise OutsideRootsError(f"{adapter_dir}: {name} leads through a link outside the directories adapters may "
                                "be loaded from")
    return path


def within(path: str, root: str) -> bool:
    """Whether real path `path` is `root` or lies under it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_adapter_name(name) -> None:
    """Raises ValueError unless `name` is 1-128 characters of letters, digits and `. _ - / : @ +`, starting with
    a letter or digit (names travel in the API's `model` field, metric labels and logs)."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        shown = repr(name)[:40] if isinstance(name, str) and name.isascii() else "the name given"
        raise ValueError(f"invalid adapter name {shown}: use 1-128 letters, digits or . _ - / : @ +, starting "
                         "with a letter or digit")


def check_start_adapters(loras: Sequence[tuple[str, str]], reserved: str | None = None) -> None:
    """Raises ValueError unless the adapters a command starts with (`--lora NAME=DIR`, repeatable) have valid
    names (`check_adapter_name`), none given twice and none `reserved` (the served base model's name), and each
    directory a valid adapter_config.json (`read_config`; AdapterError): checked before the minutes a large
    checkpoint takes to load. The weights are read with the model's, which they are checked against."""
    names = [name for name, _ in loras]
    for name, path in loras:
        check_adapter_name(name)
        if name == reserved:
            raise ValueError(f"--lora {name!r}: that is the served base model's name (--served-model-name)")
        if names.count(name) > 1:
            raise ValueError(f"--lora {name!r} is given twice")
        read_config(path)


def _is_finite(v) -> bool:
    return is_real(v) and math.isfinite(v)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(is_integer(x) for x in v)


def _alpha_ok(v) -> bool:
    return _is_finite(v) and abs(v) <= MAX_ALPHA


def _regex_ok(v: str) -> bool:
    if len(v) > _MAX_PATTERN:
        return False
    try:
        re.compile(v)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


# field: (check of a present, non-null value, what the value must be); a field absent or null takes PEFT's default
_FIELDS = {
    "peft_type": (lambda v: v == "LORA", '"LORA" (other PEFT types are not supported)'),
    "r": (lambda v: is_integer(v) and v >= 1, "a positive integer"),
    "lora_alpha": (_alpha_ok, f"a finite number of magnitude at most {MAX_ALPHA:g}"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
    "lora_bias": (lambda v: isinstance(v, bool), "true or false"),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "target_modules": (lambda v: (isinstance(v, str) and _regex_ok(v)) or _is_str_list(v),
                       f"a list of module names or a regular expression (at most {_MAX_PATTERN} characters)"),
    "rank_pattern": (lambda v: isinstance(v, dict) and all(_regex_ok(k) and is_integer(x) and x >= 1
                                                           for k, x in v.items()),
                     "an object of module patterns to positive integer ranks"),
    "alpha_pattern": (lambda v: isinstance(v, dict) and all(_regex_ok(k) and _alpha_ok(x) for k, x in v.items()),
                      f"an object of module patterns to finite alphas of magnitude at most {MAX_ALPHA:g}"),
    "layers_to_transform": (lambda v: (is_integer(v) and v >= 0) or (_is_int_list(v) and all(x >= 0 for x in v)),
                            "a layer index or a list of layer indices"),
    "modules_to_save": (_is_str_list, "a list of module names"),
    "trainable_token_indices": (lambda v: _is_int_list(v) or (isinstance(v, dict) and all(
        _is_int_list(x) for x in v.values())), "a list of token ids, or an object of module names to lists of token ids"),
    "context_length": (lambda v: is_integer(v) and v >= 1, "a positive integer"),
    "bias": (lambda v: isinstance(v, str), "a string"),
}


def read_config(adapter_dir: str, roots: Sequence[str] = ()) -> dict:
    """The checked `adapter_config.json` of `adapter_dir` (a dict; fields as PEFT writes them), inside `roots` if
    given (`adapter_file`).

    Raises:
      AdapterError: the file is missing, larger than MAX_CONFIG_BYTES, not UTF-8 JSON, nested too deeply, not
        an object, a field has the wrong type or range, or it asks for a feature jlora does not support.
    """
    path = adapter_file(adapter_dir, "adapter_config.json", roots)
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a PEFT adapter config")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise AdapterError(f"{path}: not valid UTF-8") from None
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise AdapterError(f"{path}: JSON nested too deeply") from None
    except OSError as err:
        raise AdapterError(f"{path}: cannot be read ({err.strerror})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: must hold a JSON object")
    if cfg.get("r") is None or cfg.get("lora_alpha") is None:
        raise AdapterError(f"{adapter_dir}: adapter_config.json needs 'r' and 'lora_alpha'")
    for field, (ok, what) in _FIELDS.items():
        if cfg.get(field) is not None and not ok(cfg[field]):
            raise AdapterError(f"{path}: '{field}' must be {what}")
    for key, (fine, what) in _UNSUPPORTED.items():
        value = cfg.get(key, fine)
        if value not in (fine, [], {}) and not (fine is None and not value):
            raise AdapterError(f"{adapter_dir}: {what} is not supported")
    return cfg
