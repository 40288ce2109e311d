"""The doors a user meets first: ``python -m folio``, ``--version``, help texts, values checked against the
model, clients that fail fast without a server, clean stops (SIGTERM / SIGINT, to the process or its
group, at start-up or while serving: exit 0, no traceback, no process and no temporary folder left),
Ctrl-C in a terminal, the demo's word chunks, and the prompt forms ``Client.generate`` takes.
"""

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from support.serve_helpers import ECHO, echo_chain, echo_env, poll_until

import folio
from folio.cli import build_parser
from folio.ipc.client import AsyncClient, Client


def run_folio(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "folio", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the command line ------------------------------------------------------------------------------------

def test_python_m_folio_and_version():
    r = run_folio("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"folio {folio.__version__}"
    r = run_folio()
    assert r.returncode == 2 and "serve" in r.stdout and "generate" in r.stdout


def _options(parser, path=("folio",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, path + (name,))
        elif action.option_strings and action.help != argparse.SUPPRESS and \
                not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(path), parser, action


def test_every_flag_has_help_and_shows_its_default():
    seen = 0
    for where, parser, action in _options(build_parser()):
        seen += 1
        assert action.help, f"{where} {action.option_strings[0]} has no help text"
        text = " ".join(parser.format_help().split())
        # the help line of this flag, up to the next flag
        start = text.index(action.option_strings[-1] + (" " if action.nargs != 0 else ""), text.index("options:"))
        assert "(default:" in text[start:start + 600], f"{where} {action.option_strings[0]} shows no default"
        shown = parser._get_formatter()._expand_help(action)   # the help text with the added default
        assert shown.count("(default") == 1, f"{where} {action.option_strings[0]} names its default twice: {shown!r}"
    assert seen > 40


def test_max_model_len_is_checked_against_the_model_before_loading(default_model_dir):
    r = run_folio("serve", "--max-model-len", "100000", "--port", "0", "--address", "tcp://127.0.0.1:1")
    assert r.returncode == 1
    assert "100000" in r.stderr and "8192" in r.stderr and "max_position_embeddings" in r.stderr
    assert "loading" not in r.stdout and "Traceback" not in r.stderr
    from folio.runtime.common.config import EngineConfig
    with pytest.raises(ValueError, match="exceeds"):
        EngineConfig(max_model_len=9000).resolve_max_model_len(8192)
    assert EngineConfig().resolve_max_model_len(8192) == 8192
    assert EngineConfig(max_model_len=512).resolve_max_model_len(8192) == 512


def test_quantization_of_a_quantized_gguf_is_refused_before_loading(default_model_dir):
    # the default model is a Q4_1 GGUF served as stored: --quantization has no float weights to take
    r = run_folio("serve", "--quantization", "q8_0", "--port", "0", "--address", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "--quantization q8_0" in r.stderr and "already quantized" in r.stderr, r.stderr
    assert "loading" not in r.stdout and "compiling" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    from folio.model.loader import check_quantization
    with pytest.raises(ValueError, match="already quantized"):
        check_quantization("smollm2-135m-instruct", "q4_k")
    check_quantization("smollm2-135m-instruct", None)                     # nothing to refuse
    check_quantization("smollm2-135m-instruct", "q8_0", dtype="float32")  # dequantized first: float weights


def test_a_busy_http_port_fails_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_folio("serve", "--port", str(port), "--address", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and f"{port}" in r.stderr and "--port 0" in r.stderr
    assert "loading" not in r.stdout and "Traceback" not in r.stderr


def test_the_api_key_comes_from_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from folio.cmd_serve import resolve_api_key
    monkeypatch.setenv("FOLIO_API_KEY", "from-env")
    assert resolve_api_key(None, None) == "from-env"       # as vLLM reads VLLM_API_KEY
    assert resolve_api_key("from-flag", None) == "from-flag"
    (tmp_path / "key").write_text("from-file\nsecond line\n")
    assert resolve_api_key(None, str(tmp_path / "key")) == "from-file"
    monkeypatch.delenv("FOLIO_API_KEY")
    assert resolve_api_key(None, None) is None
    (tmp_path / "empty").write_text("\n")
    for key, path, needle in ((None, tmp_path / "empty", "empty"), (None, tmp_path / "missing", "missing"),
                              ("k", tmp_path / "key", "not both")):
        with pytest.raises(ValueError, match=needle):
            resolve_api_key(key, str(path))
    # refused before anything loads, like the other flags' errors; and so is an origin that is not one
    for flags, needle in ((["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "not both"),
                          (["--allowed-origins", "evil.example"], "not an origin")):
        r = run_folio("serve", "--port", "0", "--address", f"tcp://127.0.0.1:{free_port()}", *flags)
        assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "loading" not in r.stdout


def test_allowed_origins_take_vllms_json_list_too():
    from folio.api.middleware import parse_origins
    assert parse_origins(['["http://A.example:3000/", "https://b.example"]', "http://c.example,*"]) == \
        ["http://a.example:3000", "https://b.example", "http://c.example", "*"]
    assert parse_origins(None) == []


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_serve_and_repl_take_the_zeromq_address():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for target, want in (("serve", "folio serve --address tcp://127.0.0.1:6001 --port 8081"),
                         ("repl", "folio repl --address tcp://127.0.0.1:6001")):
        r = subprocess.run(["make", "-n", "-C", root, target, "ADDRESS=tcp://127.0.0.1:6001", "PORT=8081"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and want in r.stdout, r.stdout + r.stderr


def test_clients_fail_fast_without_a_server(tmp_path):
    tcp = f"tcp://127.0.0.1:{free_port()}"
    for address in (tcp, f"ipc://{tmp_path}/nothing.sock"):
        with pytest.raises(ConnectionError, match="no folio server at " + address):
            Client(address, timeout=600)

        async def make(address=address):
            return AsyncClient(address, timeout=600)
        with pytest.raises(ConnectionError):
            asyncio.run(make())
    r = run_folio("repl", "--address", tcp)
    assert r.returncode == 1 and "no folio server at" in r.stderr and "Traceback" not in r.stderr
    r = run_folio("bench", "serve", "--address", tcp, "--num-prompts", "1")
    assert r.returncode == 1 and "no folio server at" in r.stderr and "Traceback" not in r.stderr


# -- stopping ----------------------------------------------------------------------------------------------

def _our_processes(tag: str) -> list[int]:
    """Pids (other than this one) whose command line mentions ``tag``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as g:
                        if g.read().split(")")[-1].split()[0] != "Z":
                            out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("when", ["start-up", "serving"])
@pytest.mark.parametrize("how", ["SIGTERM", "SIGTERM to the group", "SIGINT to the group", "SIGHUP to the group"])
def test_a_signal_stops_everything_cleanly(tmp_path, how, when):
    import httpx
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # start-up: the worker's initialisation takes 60 s (as loading a model does), so the signal lands in
    # it however slow the machine (checked below: the server never said it was ready)
    env = echo_env(step_s=0.02, TMPDIR=str(tmp), FOLIO_ECHO_INIT_S="60" if when == "start-up" else "0")
    address = f"ipc://{tmp}/serve.sock"
    proc = subprocess.Popen([sys.executable, "-m", "folio", "serve", "--address", address, "--port", "0", *ECHO],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = []
    try:
        stream = None
        while True:
            line = proc.stdout.readline()
            assert line, f"folio serve exited early: {''.join(lines)}"
            lines.append(line)
            if when == "start-up" and "loading" in line:
                poll_until(lambda: [p for p in _our_processes(str(tmp)) if p != proc.pid], 30,
                           "the worker to start")
                break
            if when == "serving" and "ready on" in line:
                url = line.split(" and ")[1].split()[0]
                stream = httpx.Client(base_url=url, timeout=60).stream(
                    "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 3000, "ignore_eos": True,
                                                     "stream": True})
                response = stream.__enter__()
                events = response.iter_lines()
                assert next(events).startswith("data: {")
                break
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, getattr(signal, how.split()[0]))
        if stream is not None:   # the open HTTP stream ends (an error event, then [DONE]), never hangs
            rest = [line for line in events if line]
            assert rest[-1] == "data: [DONE]" and "error" in rest[-2]
            stream.__exit__(None, None, None)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "Error" not in text, text
    assert ("ready on" in text) == (when == "serving"), text
    poll_until(lambda: not _our_processes(str(tmp)), 30, "the worker and the HTTP process to exit")
    assert sorted(os.listdir(tmp)) == [], "temporary folders left behind"


def test_ctrl_c_in_a_terminal_is_quiet(tmp_path):
    import pexpect   # in the test extra: missing, the install is broken (an error, not a skip)
    env = echo_env(step_s=0.01, TMPDIR=str(tmp_path))
    child = pexpect.spawn(sys.executable, ["-m", "folio", "serve", "--address", f"ipc://{tmp_path}/s.sock",
                                           "--port", "0", *ECHO], env=env, encoding="utf-8", timeout=120)
    try:
        child.expect("ready on")
        child.sendintr()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before, child.before
    finally:
        if child.isalive():
            child.terminate(force=True)
    # the demo, interrupted while it streams: no traceback, its server stopped, exit 0 (make stays quiet)
    demo = pexpect.spawn(sys.executable, ["-m", "folio.demo", "--no-color", "--max-tokens", "3000", "--port", "0",
                                          "--serve-arg=--worker-runner", "--serve-arg=support.ipc_fake_runner:EchoRunner",
                                          "--serve-arg=--max-model-len", "--serve-arg=4096"],
                         env={**env, "FOLIO_ECHO_STEP_S": "0.05"}, encoding="utf-8", timeout=120)
    try:
        demo.expect_exact("[5] Q:")
        demo.sendintr()
        demo.expect(pexpect.EOF)
        demo.close()
        assert "Traceback" not in demo.before and "interrupted" in demo.before, demo.before
        assert demo.exitstatus == 0
    finally:
        if demo.isalive():
            demo.terminate(force=True)
    poll_until(lambda: not _our_processes(str(tmp_path)), 30, "every process to exit")
    assert [p for p in os.listdir(tmp_path) if p.startswith("folio-")] == []


# -- the demo's output ---------------------------------------------------------------------------------------

def test_demo_prints_whole_words():
    from folio.demo import take_words
    rng = random.Random(0)
    text = " ".join(rng.choice(["a", "kv", "cache", "paged-attention", "block", "table\n", "x" * 70])
                    for _ in range(400))
    printed, buf, i = [], "", 0
    while i < len(text):
        n = rng.randint(1, 9)
        out, buf = take_words(buf + text[i:i + n], i + n >= len(text))
        i += n
        if out:
            printed.append(out)
    words = text.split()
    assert " ".join(" ".join(p.split()) for p in printed).split() == words      # nothing lost, nothing split
    assert all(w in words for p in printed for w in p.split())
    assert len(printed) > 20


def test_demo_shows_progress_answers_and_how_to_reach_http(tmp_path, default_model_dir):
    env = echo_env(step_s=0.0, TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "folio.demo", "--max-tokens", "20", "--port", "0",
                        "--serve-arg=--worker-runner", "--serve-arg=support.ipc_fake_runner:EchoRunner"],
                       capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "loading smollm2-135m-instruct" in out and "warming up" in out and "server ready" in out
    assert "curl http://127.0.0.1:" in out and "/v1/chat/completions" in out and "chat page:" in out
    assert "server stopped (exit code 0)" in out and "Traceback" not in r.stderr
    assert [p for p in os.listdir(tmp_path) if p.startswith("folio-")] == []
    # the table and the summary against the chat template's token counts of the six questions: the
    # summary counts the demo's requests only (not the server's warm-up), the prefix cache queried
    # once per prompt token; a request's cached tokens are whole blocks of a prefix it shares with
    # another question (the warm-up's blocks are dropped), the last prompt token always computed
    from folio.demo import QUESTIONS
    from folio.model.tokenizer import Tokenizer
    from folio.runtime.common.config import EngineConfig
    tok, bs = Tokenizer.from_pretrained(default_model_dir), EngineConfig().block_size
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]

    def shared(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    rows = [line.split() for line in out.splitlines() if re.match(r"\[\d\] +\d+ +\d+ +\d+ ", line)]
    assert [int(r[1]) for r in rows] == [len(p) for p in ids], out
    for i, r in enumerate(rows):
        most = min(max(shared(ids[i], p) for j, p in enumerate(ids) if j != i), len(ids[i]) - 1) // bs * bs
        assert int(r[2]) % bs == 0 and int(r[2]) <= most, (r, most)
    hits, queried = map(int, out.split("prefix cache: ")[1].split(" queried")[0].split(" of "))
    assert (queried, hits) == (sum(map(len, ids)), sum(int(r[2]) for r in rows)), out


# -- Client.generate takes LLM.generate's prompt forms ----------------------------------------------------

def test_client_generate_takes_every_prompt_form(echo_http):
    _, address, _ = echo_http
    sp = {"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    with Client(address, timeout=60) as c:
        single = c.generate({"prompt_token_ids": [1000, 1001], "cache_salt": "tenant-a"}, sp)
        assert single.outputs[0].token_ids == echo_chain(1001, 3)
        outs = c.generate(["Hello", {"prompt": "Hello"}, {"prompt_token_ids": [1200], "cache_salt": "t"},
                           {"prompt": "x", "prompt_token_ids": [1300]}],
                          [sp, sp, sp, {**sp, "max_tokens": 2}])
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3, 2]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        assert outs[2].outputs[0].token_ids == echo_chain(1200, 3) and outs[3].outputs[0].token_ids == [1301, 1302]
        for bad in ({"prompt_ids": [1]}, 5, [], {"prompt": "x", "prompt_token_ids": [1], "extra": 1}):
            with pytest.raises(ValueError):
                c.generate(bad, sp)
        with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
            c.generate(["a"], [sp, sp])
        assert c.health()["healthy"]

    async def main():
        async with AsyncClient(address, timeout=60) as ac:
            return await ac.generate([{"prompt_token_ids": [1400]}, "Hello"], sp)

    outs = asyncio.run(main())
    assert outs[0].outputs[0].token_ids == echo_chain(1400, 3) and len(outs[1].outputs[0].token_ids) == 3


def test_bench_serve_over_http_and_zmq_count_the_same_tokens(echo_http):
    from support.serve_helpers import API_KEY
    from perf.bench.serve import random_workload, run_bench
    _, address, url = echo_http
    work = random_workload(5, 4, 30, 2, 7, seed=1)
    zmq = asyncio.run(run_bench(address, work, float("inf"), 3, 0, 60))
    http = asyncio.run(run_bench(address, work, 50.0, 3, 0, 60, backend="openai", base_url=url, api_key=API_KEY))
    for s in (zmq, http):
        assert s["successful_requests"] == 5 and s["failed_requests"] == 0, s["errors"]
        assert s["total_output_tokens"] == sum(n for _, n in work)
        assert s["total_input_tokens"] == sum(len(ids) for ids, _ in work)
        assert 0 < s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"]
    bad = asyncio.run(run_bench(address, work[:1], float("inf"), 1, 0, 60, backend="openai", base_url=url,
                                api_key="wrong"))
    assert bad["failed_requests"] == 1 and "401" in bad["errors"][0]


def test_a_dead_http_process_stops_the_server_with_code_4(tmp_path):
    from folio.cmd_serve import spawn_server
    from folio.serve_http import EXIT_HTTP_PROCESS_DIED
    proc, _ = spawn_server(ECHO, address=f"ipc://{tmp_path}/s.sock", env=echo_env(TMPDIR=str(tmp_path)),
                           startup_timeout=180)
    try:
        front = [p for p in _our_processes(str(tmp_path)) if p != proc.pid and
                 b"folio.api.http_process" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(front) == 1
        os.kill(front[0], signal.SIGKILL)
        assert proc.wait(60) == EXIT_HTTP_PROCESS_DIED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    poll_until(lambda: not _our_processes(str(tmp_path)), 30, "the worker to exit")


def test_chat_template_flag_applies_to_both_doors(tmp_path):
    import httpx
    from folio.api.http_process import load_chat_template
    from folio.cmd_serve import spawn_server, stop_server
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template and load_chat_template(template) == template
    for bad in ("no-such-file.jinja", "{% for %}"):
        with pytest.raises(ValueError):
            load_chat_template(bad)
    r = run_folio("serve", "--chat-template", "{% if %}", "--port", "0", "--address", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "--chat-template" in r.stderr and "loading" not in r.stdout
    proc, address = spawn_server(ECHO + ["--chat-template", str(path)], env=echo_env(), startup_timeout=180)
    try:
        messages = [{"role": "user", "content": "hi"}]
        ids = httpx.post(proc.http_url + "/tokenize", json={"messages": messages}).json()["tokens"]
        with Client(address, timeout=60) as c:
            assert c.generate("<user>hi\n", {"max_tokens": 1}).prompt_token_ids == ids
            assert c.chat(messages, {"max_tokens": 1}).prompt_token_ids == ids          # the ZeroMQ door too
        r = httpx.post(proc.http_url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert stop_server(proc) == 0
