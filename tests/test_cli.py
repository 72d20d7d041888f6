"""The `jlora` command line and the examples, end to end on tiny random models."""

import json
import os
import runpy
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import jax
import pytest

import jlora
from jlora import cli, testing
from tests.cpu_devices import ROOT, cpu_devices_env

CFG = testing.tiny_config("llama")
SERVING = pytest.mark.serving  # `jlora serve` past its argument parsing: starlette and the rest (tests/conftest.py)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    testing.write_model(str(root / "m"), CFG, seed=1)
    testing.write_tokenizer(str(root / "m"), CFG["vocab_size"])
    testing.write_adapter(str(root / "a"), CFG, r=8, alpha=16, seed=2)
    return root


def test_generate_json_output_file(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\ufeff" + json.dumps({"prompt": "the quick fox", "adapter": "a"}) + "\n"  # a byte-order mark
                       + json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    out = tmp_path / "out.jsonl"
    rc = cli.main(["generate", "--model", str(dirs / "m"), "--lora", f"a={dirs / 'a'}", "--prompts-file", str(prompts),
                   "--max-new-tokens", "5", "--json", "--output", str(out), "--quiet", "--dtype", "float32"])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["adapter"] for r in records] == ["a", None]
    assert all(len(r["tokens"]) == 5 and isinstance(r["text"], str) for r in records)


def test_ctrl_c_ends_a_command_with_the_code_of_sigint_and_no_traceback(dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C while generating (here: KeyboardInterrupt raised from the engine's loop) prints one line and exits
    with 130, as shells report SIGINT; the --output file is left as it was and no temporary file stays. Another
    Ctrl-C on the way out ends the process by SIGINT at once (its default), where Python would raise KeyboardInterrupt
    into the interpreter's exit and print a traceback."""
    from jlora.engine import Engine

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    handler = signal.getsignal(signal.SIGINT)
    try:
        rc = cli.main(["generate", "--model", str(dirs / "m"), "--prompt", "the fox", "--quiet", "--output", str(out)])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "jlora generate: interrupted" and "Traceback" not in err
    assert out.read_text() == "earlier results\n" and os.listdir(tmp_path) == ["out.jsonl"]


def test_output_through_a_link_or_into_a_pipe_writes_there_and_replaces_nothing(dirs, tmp_path, capsys, monkeypatch):
    """--output names a link: the file it names is written, the link kept; a pipe (or a device such as /dev/null):
    written in place, never replaced by a regular file; a pipe whose reader left: a clear error."""
    from jlora.engine import Engine

    def generate(out):
        return cli.main(["generate", "--model", str(dirs / "m"), "--prompt", "the", "--max-new-tokens", "3",
                         "--quiet", "--output", str(out)])

    (tmp_path / "real.txt").write_text("old")
    os.symlink(tmp_path / "real.txt", tmp_path / "link.txt")
    assert generate(tmp_path / "link.txt") == 0
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "real.txt").read_text().startswith("[base] ")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    received = []

    def read():
        with open(pipe, "rb") as f:
            received.append(f.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert generate(pipe) == 0
    thread.join(30)
    assert not thread.is_alive(), "the output never opened the pipe"
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and received[0].startswith(b"[base] ")
    # A reader that leaves once the command opened the pipe (before the model loads), long before the write.
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    load = Engine.from_pretrained
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: (os.close(reader), load(*a, **k))[1])
    assert generate(pipe) == 1 and stat.S_ISFIFO(os.stat(pipe).st_mode)
    assert f"cannot write --output '{pipe}': Broken pipe" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["link.txt", "pipe", "real.txt"]  # no temporary file left


def test_generate_stops_at_the_models_eos_unless_told_not_to(dirs, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(dirs / "m", model)
    run = lambda *extra: (cli.main(["generate", "--model", str(model), "--prompt", "the quick fox", "--json",
                                    "--max-new-tokens", "6", "--quiet", "--dtype", "float32", *extra]),
                          json.loads(capsys.readouterr().out))
    rc, full = run()
    assert rc == 0 and len(full["tokens"]) == 6 and full["finish_reason"] == "length"
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": full["tokens"][3]}))
    rc, stopped = run()
    cut = full["tokens"].index(full["tokens"][3])
    assert rc == 0 and stopped["tokens"] == full["tokens"][:cut] and stopped["finish_reason"] == "stop"
    assert run("--ignore-eos")[1] == full
    assert run("--ignore-eos", "--temperature", "1.5", "--top-k", "1")[1] == full  # top-k 1: the argmax
    assert cli.main(["generate", "--model", str(model), "--prompt", "the", "--top-k", "-2", "--quiet"]) == 1
    assert "top_k must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent", "--prompt", "x"], "model directory '/nonexistent' does not exist"),
        (["--model", __file__, "--prompt", "x"], f"model directory {__file__!r} is not a directory"),
        (["--prompt", "the fox", "--adapter", "nope"], "adapter(s) ['nope'] asked for but not given with --lora"),
        (["--prompt", "the " * 40, "--max-seq-len", "32"], "exceeds max_seq_len=32"),
        (["--prompt", "x", "--prefill-chunk", "100"], "prefill_chunk must be a power of two >= 16, got 100"),
        # what Python makes of an argument whose bytes are not UTF-8 (b"caf\xe9"): the tokenizer raised a TypeError
        (["--prompt", "caf\udce9"], "prompt 0 is not valid Unicode text: a lone surrogate at character 3"),
        (["--prompt", "caf\udce9", "--chat"], "conversation 0 is not valid Unicode text: a lone surrogate"),
    ],
)
def test_generate_errors_are_clear_and_write_nothing(dirs, tmp_path, capsys, args, message):
    if "--model" not in args:
        args = ["--model", str(dirs / "m"), *args]
    out = tmp_path / "out.txt"
    rc = cli.main(["generate", *args, "--quiet", "--output", str(out)])
    assert rc == 1
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())  # no temporary file left either


@pytest.mark.parametrize("args, message", [
    (["--output", "{tmp}"], "--output '{tmp}' is a directory"),
    (["--output", "{tmp}/no/such/dir/out.txt"], "cannot write --output '{tmp}/no/such/dir/out.txt': No such file"),
    (["--lora", "a={a}", "--lora", "a={a}"], "--lora 'a' is given twice"),
    (["--lora", "a={a}", "--adapter", "b"],
     "adapter(s) ['b'] asked for but not given with --lora NAME=DIR (given: ['a'])"),
])
def test_generate_refuses_an_output_or_adapters_it_cannot_take_before_loading(dirs, tmp_path, capsys, monkeypatch,
                                                                              args, message):
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    args = [a.format(tmp=tmp_path, a=dirs / "a") for a in args]
    assert cli.main(["generate", "--model", str(dirs / "m"), "--prompt", "x", "--quiet", *args]) == 1
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "need a finite temperature >= 0 and 0 < top_p <= 1, got -1.0, 1.0"),
    (["--temperature", "inf"], "need a finite temperature >= 0"),
    (["--top-p", "0"], "need a finite temperature >= 0 and 0 < top_p <= 1, got 0.0, 0.0"),
    (["--top-k", "-1"], "top_k must be an integer >= 0 (0: off), got -1"),
    (["--min-p", "nan"], "min_p must be a number in [0, 1] (0: off), got nan"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a number in (0, 2] (1: off), got 0.0"),
    (["--frequency-penalty", "3"], "frequency_penalty must be a number in [-2, 2] (0: off), got 3.0"),
    (["--presence-penalty", "-2.5"], "presence_penalty must be a number in [-2, 2] (0: off), got -2.5"),
    (["--seed", "-1"], "seeds must be in [0, 2**32), got [-1]"),
    (["--seed", str(2**32)], f"seeds must be in [0, 2**32), got [{2**32}]"),
])
def test_generate_refuses_sampling_options_out_of_range_before_loading(dirs, capsys, monkeypatch, args, message):
    """What `Engine.generate` would refuse once the model had loaded (seconds to minutes), refused at once."""
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(["generate", "--model", str(dirs / "m"), "--prompt", "x", "--quiet", *args]) == 1
    err = capsys.readouterr().err
    assert f"jlora generate: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("path, why", [("missing.jsonl", "No such file or directory"), (".", "Is a directory")])
def test_a_prompts_file_that_cannot_be_read_is_named_before_loading(dirs, tmp_path, capsys, monkeypatch, path, why):
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    path = str(tmp_path / path)
    assert cli.main(["generate", "--model", str(dirs / "m"), "--prompts-file", path, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"jlora generate: error: cannot read --prompts-file {path!r}: {why}" in err and "Traceback" not in err


@pytest.mark.parametrize("line, message", [
    ('{"prompt_ids": 5}', "p.jsonl:2: 'prompt_ids' must be a list of integer token ids"),
    ('{"prompt_ids": "the fox"}', "'prompt_ids' must be a list of integer token ids"),
    ('{"prompt": 7}', "'prompt' must be text"),
    ('{"prompt": [1, 2]}', "'prompt' must be text"),
    ('[1, 2]', "not a JSON object"),
    ('{"prompt_ids": [1], "adapter": 3}', "'adapter' must be a name or null"),
    ('{"prompt_ids": [1.5, 2]}', "'prompt_ids' must be a list of integer token ids"),
    ('{"prompt_ids": [true]}', "'prompt_ids' must be a list of integer token ids"),
    ('{"prompt_ids": [[1]]}', "'prompt_ids' must be a list of integer token ids"),
    ('{"prompt_ids": [1}', "p.jsonl:2: not JSON"),
    pytest.param('{"prompt_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "p.jsonl:2: JSON nested too deeply",
                 id="nested 100k deep"),
    pytest.param('{"prompt_ids": [' + "9" * 5000 + "]}", "p.jsonl:2: a number of more than 4300 digits",
                 id="a 5000-digit id"),
    ('{"prompt_ids": [1], "max_new_tokens": 3, "Adapter": "a"}',
     "p.jsonl:2: unknown key(s) 'Adapter', 'max_new_tokens': a request takes 'adapter', 'messages', 'prompt', "
     "'prompt_ids'"),
    ('{"prompt": "the", "prompt_ids": [1]}', "give exactly one of 'prompt' (text), 'prompt_ids' or 'messages'"),
    ('{"messages": [{"role": "user", "content": "the"}]}', "p.jsonl:2: 'messages' needs --chat"),
    ('{"messages": []}', "'messages' must be a non-empty list of message objects"),
    ('{"messages": ["the"]}', "'messages' must be a non-empty list of message objects"),
    (b'{"prompt": "caf\xe9"}', "p.jsonl:2: not UTF-8 text (byte 16 of the line: invalid continuation byte)"),  # Latin-1
])
def test_a_bad_prompts_file_line_is_a_clear_error(dirs, tmp_path, capsys, line, message):
    """Each line of a prompts file is checked: a wrong type is an error naming the line and the field, not a
    traceback."""
    prompts = tmp_path / "p.jsonl"
    line = line if isinstance(line, bytes) else line.encode()
    prompts.write_bytes(json.dumps({"prompt_ids": [1, 2]}).encode() + b"\n" + line + b"\n")
    rc = cli.main(["generate", "--model", str(dirs / "m"), "--prompts-file", str(prompts), "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_chat_renders_the_chat_template(dirs, tmp_path, capsys):
    """--chat renders a text prompt as one user message, or a line's messages, with the model's template (the
    test template: "ROLE CONTENT " per message, then "assistant"), then generates as Engine.chat does."""
    from jlora.engine import Engine

    engine = Engine.from_pretrained(str(dirs / "m"), dtype="float32", progress=False)
    want = [engine.generate([engine.tokenizer.encode(text).ids], [None], max_new_tokens=4)[0].text
            for text in ("user the lazy dog assistant", "system be quick user the fox assistant")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the lazy dog"}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be quick"}, {"role": "user", "content": "the fox"}]}) + "\n")
    base = ["generate", "--model", str(dirs / "m"), "--chat", "--max-new-tokens", "4", "--quiet", "--dtype", "float32",
            "--json"]
    assert cli.main(base + ["--prompts-file", str(prompts)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in records] == want and records[0]["messages"][0]["content"] == "the lazy dog"
    assert cli.main(base + ["--prompt", "the lazy dog"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == want[0]
    prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n")
    assert cli.main(base + ["--prompts-file", str(prompts)]) == 1
    assert "--chat renders text: give 'prompt' or 'messages', not 'prompt_ids'" in capsys.readouterr().err
    prompts.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    assert cli.main(base + ["--prompts-file", str(prompts)]) == 1
    err = capsys.readouterr().err
    assert "conversation 0: messages[0] must be an object with a string 'role' and a 'content' that is" in err


def test_generate_tensor_parallel_matches_one_device(dirs, tmp_path):
    """`--tensor-parallel 2` on 2 virtual CPU devices (a subprocess: the device count is set before JAX starts)
    generates what one device does; asking for more devices than there are is a clear error."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3], "adapter": "a"}) + "\n" + json.dumps({"prompt": "the fox"}))
    env = cpu_devices_env(2)
    outputs = []
    for tp in ("1", "2", "4"):
        out = tmp_path / f"out{tp}.jsonl"
        result = subprocess.run(
            [sys.executable, "-m", "jlora", "generate", "--model", str(dirs / "m"), "--lora", f"a={dirs / 'a'}",
             "--prompts-file", str(prompts), "--max-new-tokens", "4", "--dtype", "float32", "--json", "--quiet",
             "--tensor-parallel", tp, "--output", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
        outputs.append((result, out))
    (one, out_one), (two, out_two), (four, out_four) = outputs
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    def tokens(out):
        return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]

    assert tokens(out_two) == tokens(out_one)
    assert four.returncode == 1 and "tensor_parallel=4 needs 4 devices" in four.stderr and not out_four.exists()


def test_bad_lora_spec(dirs, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(dirs / "m"), "--lora", "no-equals-sign", "--prompt", "x"])
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", str(dirs / "m"), "--lora", f"a b={dirs / 'a'}"])
    assert "invalid adapter name" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--quiet"], pytest.param(["serve"], marks=SERVING),
                                     ["serve", "--replicas", "1"]])
def test_a_bad_start_adapter_stops_every_command_before_loading(dirs, tmp_path, capsys, monkeypatch, command):
    """A `--lora` directory without a valid adapter_config.json stops generate, serve and serve on Ray before the
    model loads or Ray starts (on Ray it failed in each replica, after loading, as 'Failed to update the
    deployments')."""
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    if "--replicas" in command:
        jlora_ray = pytest.importorskip("jlora.ray")
        monkeypatch.setattr(jlora_ray.ray, "init", lambda **kw: pytest.fail("Ray started"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"r": 8}')
    for path, message in [("bad", "adapter_config.json needs 'r' and 'lora_alpha'"),
                          ("missing", "adapter_config.json not found")]:
        argv = [command[0], "--model", str(dirs / "m"), "--lora", f"a={dirs / 'a'}",
                "--lora", f"b={tmp_path / path}", *command[1:]]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / path}: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--allow-runtime-lora"], "needs at least one --lora-root DIR"),
    (["--allow-runtime-lora", "--lora-root", "/nonexistent"], "--lora-root '/nonexistent' is not a directory"),
    (["--max-body-bytes", "0"], "max_body_bytes must be >= 1"),
    (["--header-timeout", "0"], "header_timeout must be > 0 seconds"),
])
@SERVING
def test_serve_refuses_unsafe_or_bad_options_before_loading(dirs, capsys, args, message):
    assert cli.main(["serve", "--model", str(dirs / "m"), *args]) == 1
    assert message in capsys.readouterr().err


@SERVING
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(dirs, capsys, monkeypatch):
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", str(dirs / "m"), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(dirs / "m"), "--host", "no-such-host.invalid"]) == 1
    assert "cannot listen on no-such-host.invalid:8000" in capsys.readouterr().err


def test_serve_on_a_local_ray_cluster_checks_its_address_before_starting_ray(dirs, capsys, monkeypatch):
    """Ray Serve's proxy listens on this machine when RAY_ADDRESS is unset: an address in use stops the start
    before Ray does (Ray's own failure is a remote traceback, seconds later), and port 0 is a free port given to
    the proxy (which would print 0)."""
    jlora_ray = pytest.importorskip("jlora.ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in ("init", "shutdown"):
        monkeypatch.setattr(jlora_ray.ray, name, lambda **kw: None)
    monkeypatch.setattr(jlora_ray.serve, "shutdown", lambda: None)
    before = signal.getsignal(signal.SIGTERM)
    started = []

    def start(http_options):
        started.append(http_options)
        raise RuntimeError("stopped before the deployment")

    monkeypatch.setattr(jlora_ray.serve, "start", start)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", str(dirs / "m"), "--port", str(port), "--replicas", "1"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert not started
    assert cli.main(["serve", "--model", str(dirs / "m"), "--port", "0", "--replicas", "1"]) == 1
    (options,) = started
    assert options["host"] == "127.0.0.1" and options["port"] > 0
    assert signal.getsignal(signal.SIGTERM) is before  # the command's SIGTERM handler goes with it
    socket.create_server(("127.0.0.1", options["port"])).close()  # free again for the proxy to take


@pytest.mark.parametrize("file, content, message", [
    ("tokenizer_config.json", "{oops", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", '{"chat_template": "{% for m in messages %}{{ m }"}', "the chat template does not compile"),
    ("tokenizer_config.json", '{"chat_template": 5}', "chat_template must be a string or a list of named templates"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id must be a token id or a list of them"),
    ("generation_config.json", "[2]", "generation_config.json must hold a JSON object"),
    ("generation_config.json", '{"temperature": -0.5}', "temperature must be a number >= 0, got -0.5"),
    ("generation_config.json", '{"top_p": 0}', "top_p must be a number in (0, 1], got 0"),
    ("generation_config.json", '{"top_k": 2.5}', "top_k must be an integer >= 0, got 2.5"),
    ("generation_config.json", '{"max_new_tokens": "64"}', "max_new_tokens must be an integer >= 1, got '64'"),
    ("generation_config.json", '{"repetition_penalty": 2.5}', "repetition_penalty must be a number in (0, 2], got 2.5"),
])
@SERVING
def test_serve_refuses_a_broken_tokenizer_or_generation_config_before_loading(dirs, tmp_path, capsys, monkeypatch, file,
                                                                        content, message):
    from jlora.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    model = tmp_path / "m"
    shutil.copytree(dirs / "m", model)
    (model / file).write_text(content)
    assert cli.main(["serve", "--model", str(model), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert f"jlora serve: error: {model / file}" in err and message in err


@SERVING
def test_serve_says_which_sampling_defaults_come_from_the_model(dirs, tmp_path, capsys, monkeypatch):
    from jlora.engine import Engine

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(Engine, "from_pretrained", stop)
    model = tmp_path / "m"
    shutil.copytree(dirs / "m", model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    assert cli.main(["serve", "--model", str(model), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert ("jlora: requests that do not set them take the model's generation_config.json temperature=0.7, "
            "top_p=0.8, top_k=20, repetition_penalty=1.05 (--generation-config none: OpenAI's defaults)") in err
    assert "stopped before loading" in err
    assert cli.main(["serve", "--model", str(model), "--port", "0", "--generation-config", "none"]) == 1
    assert "generation_config.json" not in capsys.readouterr().err


def test_demo_into_a_path_it_cannot_make_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["demo", "--out", str(tmp_path / "file")]) == 1
    err = capsys.readouterr().err
    assert err == f"jlora demo: error: --out {str(tmp_path / 'file')!r} is not a directory\n"
    assert cli.main(["demo", "--out", str(tmp_path / "file" / "sub")]) == 1  # a file on the way
    err = capsys.readouterr().err
    assert err.startswith("jlora demo: error: [Errno 20] Not a directory") and "Traceback" not in err


def test_demo_passes():
    from jlora.demo import run_demo

    assert run_demo(max_new_tokens=4)


@pytest.mark.parametrize("example", ["jit_inference_loop.py", "lora_in_my_module.py"])
def test_examples_run(example, capsys):
    runpy.run_path(os.path.join(ROOT, "examples", example), run_name="__main__")
    assert capsys.readouterr().out


def test_console_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "jlora", "--help"], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0 and "generate" in result.stdout and "demo" in result.stdout


def test_a_package_missing_from_the_install_is_named_without_a_traceback(dirs, tmp_path):
    """`jlora serve` where starlette cannot be imported (an install made with pip's --no-deps, say): exit code 1
    and one line naming the package, before the model loads."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['starlette'] = None  # import fails\n")
    result = subprocess.run([sys.executable, "-m", "jlora", "serve", "--model", str(dirs / "m")], capture_output=True,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("jlora serve: error: the package 'starlette' is not installed; "
                                                      "jlora needs it (pip install jlora installs it)")
    assert "Traceback" not in result.stderr


def test_a_ctrl_c_while_the_command_line_loads_waits_for_the_imports_then_ends_it(dirs):
    """`import jlora` loads no JAX: the command line imports it, and the command's packages, in `main` with Ctrl-C
    held back, since an interrupt inside a C extension's import fails with an ImportError traceback or aborts the
    process. A Ctrl-C then (here: sent from inside the parser's build) lets the imports end, then ends the command
    as any other Ctrl-C: 130, one line, no traceback."""
    code = f"""if True:
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
        import jlora
        print("jax before main:", "jax" in sys.modules, flush=True)
        from jlora import cli
        build, built = cli._parser, []
        def parser():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # held back: the imports go on
            built.append(build())
            return built[0]
        cli._parser = parser
        rc = cli.main(["generate", "--model", {str(dirs / "m")!r}, "--prompt", "x", "--quiet"])
        print("built:", bool(built), "engine imported:", "jlora.engine" in sys.modules, flush=True)
        sys.exit(rc)"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["jax before main: False", "built: True engine imported: True"]
    assert result.stderr.strip() == "jlora: interrupted"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"jlora {jlora.__version__} (JAX {jax.__version__})\n"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU refusal")
def test_bench_without_a_gpu_says_so(capsys):
    assert cli.main(["bench", "kernels", "--quick"]) == 1
    assert "need an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--ray-replica-options", "{oops"], "--ray-replica-options is not valid JSON"),
    (["--ray-replica-options", "[1]"], "must be a JSON object"),
    (["--ray-replica-options", '{"foo": 1}'], "bad Ray Serve deployment options (Deployment.options() got an "
                                              "unexpected keyword argument 'foo')"),
    (["--ray-replica-options", '{"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}}'],
     "max_replicas (2) must be greater than or equal to min_replicas (5)"),
    (["--replicas", "2", "--ray-replica-options", '{"autoscaling_config": {"max_replicas": 2}}'],
     "give --replicas or an autoscaling_config in --ray-replica-options, not both"),
    (["--replicas", "2", "--allow-runtime-lora", "--lora-root", "."], "runtime adapter loads would reach one replica"),
])
def test_serve_on_ray_refuses_bad_options_before_starting_ray(args, message, capsys, tmp_path, monkeypatch):
    jlora_ray = pytest.importorskip("jlora.ray")
    monkeypatch.setattr(jlora_ray.ray, "init", lambda **kw: pytest.fail("Ray started"))
    testing.write_model(str(tmp_path), testing.tiny_config("llama"))
    assert cli.main(["serve", "--model", str(tmp_path), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_selfcheck_passes_and_fails_a_wrong_backend(capsys, monkeypatch):
    """`jlora selfcheck`: every backend in both types against the float64 oracle; a backend that returns a wrong
    delta (here gather's, off by 0.1 %) or changes the base-only tokens' rows (pallas', by 1 %) is a FAIL row and
    exit status 1."""
    assert cli.main(["selfcheck"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert sorted((r[0], r[1], r[-1]) for r in rows) == sorted(
        (b, d, "ok") for b in ("reference", "ragged", "gather", "pallas") for d in ("float32", "bfloat16"))
    import jlora.selfcheck

    right = jlora.selfcheck.lora_linear

    def wrong(*args, backend, **kwargs):
        out = right(*args, backend=backend, **kwargs)
        return out + {"gather": 0.001 * (out - args[1]), "pallas": 0.01 * args[1]}.get(backend, 0)

    monkeypatch.setattr(jlora.selfcheck, "lora_linear", wrong)
    assert cli.main(["selfcheck"]) == 1
    failed = [line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.endswith("FAIL")]
    assert failed == [["gather", "float32"], ["pallas", "float32"], ["pallas", "bfloat16"]]  # gather's 0.1 %
    # is within bfloat16's bar


def test_ctrl_c_that_lands_in_a_garbage_collection_still_ends_the_command(dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C while a garbage collection runs a Python callback (JAX has one) raises KeyboardInterrupt in the
    callback, where Python used to drop it, printing an "Exception ignored" traceback, and the command went on.
    Now it ends the command as any Ctrl-C does: one line, 130."""
    import gc

    from jlora.engine import Engine

    pressed = []

    def callback(phase, info):
        if phase == "start" and pressed and len(pressed) == 1:
            pressed.append(True)
            raise KeyboardInterrupt

    def generate(self, *args, **kwargs):
        pressed.append(True)
        gc.collect()
        for _ in range(1000):  # the command goes on for 10 s: only the interrupt ends it (short waits: a test
            time.sleep(0.01)   # runner's thread may block SIGINT, which then lands between them)
        raise AssertionError("not interrupted")

    monkeypatch.setattr(Engine, "generate", generate)
    gc.callbacks.insert(0, callback)
    handler, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as in a terminal (xdist's workers differ)
    try:
        start = time.monotonic()
        rc = cli.main(["generate", "--model", str(dirs / "m"), "--prompt", "the fox", "--quiet"])
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "jlora generate: interrupted", err
    assert len(pressed) == 2 and time.monotonic() - start < 5 and sys.unraisablehook is hook
