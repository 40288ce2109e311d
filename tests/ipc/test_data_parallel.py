"""``folio serve --data-parallel-size 2 --data-parallel-backend ray``: two replicas behind one door.

The replicas run the real scheduler, engine, tokenizer and IPC with the EchoRunner worker
(tests/support/ipc_fake_runner.py: next id = last id + 1), so the expected outputs are independent of the
code under test. One Ray cluster serves the module: started here with ``ray start --head`` on
loopback (which also tests joining an existing cluster, ``--ray-address``) and stopped at the end;
one test starts a ``folio serve`` with its own local cluster and checks that nothing is left.
Every wait is a poll with a deadline. The real-model equality test is ``slow``.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import httpx
import ray  # noqa: F401 - in the test extra: missing, the install is broken (an error, not a skip)

from folio.cmd_serve import spawn_server, stop_server
from folio.ipc.client import Client, ServerError
from folio.runtime.common.sampling_params import SamplingParams

from support.serve_helpers import ECHO, echo_chain, echo_env, pid_gone, poll_until

GREEDY = dict(temperature=0.0)
# the module's cluster is a private one on loopback: no token authentication (Ray >= 2.5x enables it
# by default for `ray start`, and a joining driver then needs the token file), and Ray's
# single-machine mode (its node IP, so every port it listens on, is loopback)
NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair():
    """A port P of 127.0.0.1 with P + 1 free too (the two replicas' doors)."""
    for _ in range(50):
        p = _free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports")


RPC_PORT = _free_port_pair()


def _listening(pids):
    """``(ip, port, pid)`` of every TCP / UDP socket of ``pids`` that listens (TCP) or is bound
    (UDP), from /proc/net/{tcp,tcp6,udp,udp6} and each process's socket inodes."""
    import ipaddress
    inodes = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    out = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode not in inodes or (table.startswith("tcp") and state != "0A"):   # 0A: LISTEN
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            out.append((ip, int(hexport, 16), inodes[inode]))
    return out


def _loopback(ip):
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _descendants(pid):
    """Every live process below ``pid`` (from /proc)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray head on loopback with 2 logical CPUs (``ray start --head --block``, stopped at the end)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    proc = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(port), "--node-ip-address",
                             "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard", "false",
                             "--disable-usage-stats"], env=echo_env(**NO_AUTH), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"ray start exited with {proc.returncode}")
            r = subprocess.run([ray_bin, "status", "--address", address], capture_output=True, timeout=30,
                               env=echo_env(**NO_AUTH))
            return r.returncode == 0
        poll_until(up, 120, "the Ray head to come up")
        yield address
    finally:
        procs = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)            # ray start --block stops its cluster on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        poll_until(lambda: all(pid_gone(p) for p in procs), 60, "the Ray head's processes to end")


@pytest.fixture(scope="module")
def dp_server(ray_cluster):
    proc, address = spawn_server([*ECHO, "--data-parallel-size", "2", "--ray-address", ray_cluster,
                                  "--max-num-seqs", "8", "--heartbeat-timeout", "5",
                                  "--data-parallel-rpc-port", str(RPC_PORT)],
                                 env=echo_env(step_s=0.02, **NO_AUTH), startup_timeout=300)
    client = Client(address, timeout=60)
    try:
        yield proc, client
    finally:
        client.close()
        reps = []
        try:
            reps = Client(address, timeout=10).health()["replicas"]
        except Exception:
            pass
        assert stop_server(proc) == 0
        pids = [p for r in reps for p in (r.get("pid"), r.get("worker_pid")) if p]
        poll_until(lambda: all(pid_gone(p) for p in pids), 60, "every replica and worker to end")


def _routed(client):
    return [r["routing"]["num_routed"] for r in client.get_metrics()["replicas"]]


def test_greedy_outputs_equal_one_engines_and_spread(dp_server):
    proc, client = dp_server
    before = _routed(client)
    prompts = [[100 + 7 * k + j for j in range(5 + k)] for k in range(6)]
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: client.generate(prompt_token_ids=p, sampling_params=SamplingParams(
            max_tokens=6, **GREEDY)), prompts))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == echo_chain(p[-1], 6)
    after = _routed(client)
    assert sum(after) - sum(before) == 6
    assert all(a > b for a, b in zip(after, before)), "distinct prompts at once went to both replicas"
    # text prompts and the HTTP door go through the same router
    r = httpx.post(proc.http_url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": [5, 6, 7],
                                                            "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def _hit_rate_workload(salt):
    """4 prefixes of 3 blocks (block_size 16) x 4 requests with distinct tails, interleaved."""
    return [([2000 + 100 * p + j for j in range(48)] + [9000 + 10 * p + r] * 5, salt)
            for r in range(4) for p in range(4)]


def _single_engine_hit_rate(workload):
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    from support.ipc_fake_runner import EchoRunner
    config = EngineConfig(device="cpu", max_model_len=512, async_scheduling=False)
    engine = LLMEngine(config, executor=EchoRunner(config, num_blocks=512))
    for k, (ids, salt) in enumerate(workload):
        engine.add_request(str(k), None, SamplingParams(max_tokens=2, **GREEDY), prompt_token_ids=ids, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
    m = engine.get_metrics()
    return m["prefix_cache_hits"] / m["prefix_cache_queries"]


def test_shared_prefixes_route_to_one_replica(dp_server):
    proc, client = dp_server
    workload = _hit_rate_workload("prefix-routing-test")
    single = _single_engine_hit_rate(workload)
    assert single > 0.5                     # 12 of 16 requests reuse 48 of their 53 tokens
    m0 = client.get_metrics()
    for ids, salt in workload:
        client.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=2, **GREEDY), cache_salt=salt)
    m1 = client.get_metrics()
    hits = m1["prefix_cache_hits"] - m0["prefix_cache_hits"]
    queries = m1["prefix_cache_queries"] - m0["prefix_cache_queries"]
    assert hits / queries >= 0.9 * single, (hits / queries, single)
    prefix_routed = sum(r["routing"]["num_prefix_routed"] for r in m1["replicas"]) - \
        sum(r["routing"]["num_prefix_routed"] for r in m0["replicas"])
    assert prefix_routed == 12
    # another salt shares no prefix with these: no affinity, no hits
    ids, _ = workload[0]
    out = client.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=2, **GREEDY),
                          cache_salt="another-tenant")
    assert out.num_cached_tokens == 0


def test_metrics_and_health_per_replica(dp_server):
    proc, client = dp_server
    client.generate(prompt_token_ids=[11, 12, 13], sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    m = client.get_metrics()
    assert m["data_parallel_size"] == 2 and [r["engine"] for r in m["replicas"]] == [0, 1]
    assert m["prefix_cache_queries"] == sum(r["prefix_cache_queries"] for r in m["replicas"])
    assert m["serving"]["generation_tokens"] == sum(r["serving"]["generation_tokens"] for r in m["replicas"])
    text = httpx.get(proc.http_url + "/metrics", timeout=30).text
    for engine in ("0", "1", "total"):
        assert f'folio:generation_tokens_total{{engine="{engine}",model_name="smollm2-135m-instruct"}}' in text \
            or f'folio:generation_tokens_total{{model_name="smollm2-135m-instruct",engine="{engine}"}}' in text, engine
    h = httpx.get(proc.http_url + "/health", timeout=30)
    assert h.status_code == 200
    body = h.json()
    assert [r["engine"] for r in body["replicas"]] == [0, 1]
    assert all(r["healthy"] and r["worker_alive"] for r in body["replicas"])


def test_killed_replica_fails_its_streams_retries_the_rest_and_rejoins(dp_server):
    """20 requests at once spread over the two replicas; with max_num_seqs 8, at least 2 of a
    replica's wait there without output when it is killed: those are retried on the other replica
    and complete; those that streamed fail with replica_died. The other replica's requests are
    untouched."""
    import threading
    proc, client = dp_server
    m0 = client.get_metrics()
    prefix = [7000 + j for j in range(48)]
    prompts = [prefix + [100 + k] for k in range(20)]
    results = [None] * len(prompts)

    def run(k):
        ids = []
        try:
            for d in client.generate_stream(prompt_token_ids=prompts[k],
                                            sampling_params=SamplingParams(max_tokens=150, **GREEDY)):
                ids += d.token_ids
            results[k] = ("ok", ids)
        except ServerError as e:
            results[k] = (e.code, ids)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(prompts))]
    for t in threads:
        t.start()

    def loaded(m):
        in_flight = [r["routing"]["num_requests_routed_in_flight"] for r in m["replicas"]]
        if sum(in_flight) == len(prompts) and any(n >= 10 and r.get("num_running", 0) == 8
                                                  for n, r in zip(in_flight, m["replicas"])):
            return m["replicas"]
        return None

    reps = poll_until(lambda: loaded(client.get_metrics()), 60, "20 requests in flight, 8 running on a replica of 10+")
    victim = next(r for r in reps if r["routing"]["num_requests_routed_in_flight"] >= 10 and r["num_running"] == 8)
    others = sum(r["routing"]["num_requests_routed_in_flight"] for r in reps if r is not victim)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results), results
    retried = client.get_metrics()["router"]["num_retried"] - m0["router"]["num_retried"]
    assert retried >= 2
    ok = [k for k, r in enumerate(results) if r[0] == "ok"]
    assert len(ok) == others + retried, (others, retried, results)
    for k, (code, ids) in enumerate(results):
        if code == "ok":
            assert ids == echo_chain(prompts[k][-1], 150)
        else:
            assert code == "replica_died" and ids == echo_chain(prompts[k][-1], len(ids)) and ids
    # new requests go to the living replica meanwhile
    out = client.generate(prompt_token_ids=[40, 41], sampling_params=SamplingParams(max_tokens=3, **GREEDY))
    assert out.outputs[0].token_ids == echo_chain(41, 3)
    # Ray restarts it (a new process) and it rejoins
    e = victim["engine"]
    rejoined = poll_until(lambda: (lambda h: h if h["replicas"][e]["healthy"] and h["replicas"][e]["pid"] != victim["pid"]
                                   else None)(client.health()), 120, f"replica {e} to be restarted by Ray")
    assert rejoined["replicas"][e]["num_restarts"] == 1
    poll_until(lambda: pid_gone(victim["worker_pid"]), 30, "the dead replica's worker to end")
    before = _routed(client)
    for k in range(4):
        client.generate(prompt_token_ids=[500 + k], sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    after = _routed(client)
    assert after[e] > before[e], "the restarted replica takes requests again"


def test_local_cluster_started_and_stopped_by_ctrl_c():
    """Without --ray-address folio serve starts a local Ray cluster; Ctrl-C (SIGINT to its process
    group, as a terminal sends it) stops the replicas and the cluster, exit 0, nothing left behind.
    While it serves, every port of it (Ray's GCS, raylet, object manager, workers, and the
    replicas' doors) listens on loopback only; its start says each replica as it is ready."""
    lines = []
    proc, address = spawn_server([*ECHO, "--data-parallel-size", "2"], env=echo_env(), startup_timeout=300,
                                 start_new_session=True, on_line=lines.append)
    try:
        with Client(address, timeout=60) as c:
            out = c.generate(prompt_token_ids=[7, 8], sampling_params=SamplingParams(max_tokens=2, **GREEDY))
            assert out.outputs[0].token_ids == echo_chain(8, 2)
            reps = c.health()["replicas"]
        procs = _descendants(proc.pid)
        assert {r["pid"] for r in reps} <= set(procs), "the replicas run in the cluster folio serve started"
        sockets = _listening([proc.pid, *procs])
        ports = {port for _, port, _ in sockets}
        assert {int(r["address"].rsplit(":", 1)[1]) for r in reps} <= ports, sockets   # the doors are seen
        assert len(sockets) >= 4, sockets                   # GCS, raylet (2), the doors: at least
        outward = [(str(ip), port, pid) for ip, port, pid in sockets if not _loopback(ip)]
        assert not outward, f"listening beyond loopback: {outward}"
        for i in (0, 1):
            assert any(f"replica {i} of 2 up after" in line and "its door tcp://127.0.0.1:" in line for line in lines), lines
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(120)
    finally:
        stop_server(proc)
    assert code == 0
    poll_until(lambda: all(pid_gone(p) for p in procs), 60, "every process folio serve started to end")


def _handshake(address, keys=None):
    """The first handshake outcome of a DEALER connecting to ``address`` (as a CURVE client of
    ``keys``, or without security): ``HANDSHAKE_SUCCEEDED`` or one of the ``HANDSHAKE_FAILED_*``."""
    import zmq
    import zmq.utils.monitor
    from folio.ipc.transport import curve_client
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        curve_client(s, keys)
    mon = s.get_monitor_socket()
    s.connect(address)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if mon.poll(500):
                event = zmq.Event(zmq.utils.monitor.recv_monitor_message(mon)["event"])
                if event.name.startswith("HANDSHAKE"):
                    return event.name
        raise AssertionError(f"no handshake with {address} within 30 s")
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


def test_replica_doors_listen_on_the_chosen_loopback_ports_and_admit_only_the_router(dp_server):
    from folio.ipc.transport import CurveKeys
    proc, client = dp_server
    reps = client.health()["replicas"]
    assert [r["address"] for r in reps] == [f"tcp://127.0.0.1:{RPC_PORT}", f"tcp://127.0.0.1:{RPC_PORT + 1}"]
    for r in reps:
        # no CURVE: refused (libzmq reports a security mismatch as _PROTOCOL or _NO_DETAIL by version)
        assert _handshake(r["address"]).startswith("HANDSHAKE_FAILED_")
        stranger = CurveKeys.generate()        # CURVE with keys of another cluster: refused
        assert _handshake(r["address"], stranger).startswith("HANDSHAKE_FAILED_")
    # and the router still serves through them
    out = client.generate(prompt_token_ids=[21, 22], sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    assert out.outputs[0].token_ids == echo_chain(22, 2)


def test_concurrent_chats_sharing_a_template_spread_over_the_replicas(dp_server):
    """Eight chats at once share the chat template's first blocks: they spread over both replicas
    (affinity alone sent all eight to one)."""
    import concurrent.futures as cf
    proc, client = dp_server
    before = _routed(client)
    questions = [f"Question number {k}: what is {k} plus {k}?" for k in range(8)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda q: client.chat([{"role": "user", "content": q}], sp), questions))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    got = [a - b for a, b in zip(_routed(client), before)]
    assert sum(got) == 8 and min(got) >= 2, got


@pytest.mark.slow
def test_real_model_greedy_two_replicas_equal_one_engine(ray_cluster):
    from folio.llm import LLM
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    want = [o.outputs[0].token_ids for o in LLM(device="cpu").generate(prompts, sp)]
    proc, address = spawn_server(["--device", "cpu", "--data-parallel-size", "2", "--ray-address", ray_cluster],
                                 startup_timeout=900)
    try:
        with Client(address, timeout=300) as c:
            got = [c.generate(p, sp).outputs[0].token_ids for p in prompts]
    finally:
        stop_server(proc)
    assert got == want


@pytest.mark.slow
def test_worker_death_retries_unstarted_requests_and_ray_restarts_the_replica(dp_server):
    """kill -9 of a replica's worker (not the replica's process): the replica errors its requests
    (worker_died) and exits; the router retries what had not started, and Ray restarts it."""
    proc, client = dp_server
    h = client.health()
    e = 1
    victim = h["replicas"][e]
    restarts = victim["num_restarts"]
    os.kill(victim["worker_pid"], signal.SIGKILL)
    for k in range(6):
        out = client.generate(prompt_token_ids=[10 + k, 20 + k], sampling_params=SamplingParams(max_tokens=3, **GREEDY))
        assert out.outputs[0].token_ids == echo_chain(20 + k, 3)
    poll_until(lambda: (lambda r: r["healthy"] and r["pid"] != victim["pid"] and r["num_restarts"] == restarts + 1)(
        client.health()["replicas"][e]), 120, f"replica {e} to be restarted by Ray")
