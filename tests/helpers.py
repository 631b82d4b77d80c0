"""Helpers shared by several test files: torchrun jobs, metrics rows, action-mask runs."""

import asyncio
import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from aiohttp import web

from rl2gem.procs import app_runner, free_port

ROOT = Path(__file__).parents[1]


def torchrun_command(nproc: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a ``torchrun --standalone`` job run from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep the caller's too
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def torchrun(nproc: int, *args: str, timeout: float = 600, cwd=None, env=None) -> str:
    """Run a torchrun job (``args``: a script and its arguments) to the end; assert it succeeded (its
    output tails in the message); its stdout.

    The ranks are forked from :class:`RankZygote` with the environment ``torchrun --standalone``
    gives them, not started by the launcher (6 s of imports per rank saved); the README's commands
    and ``make run`` use the real launcher. ``RL2GEM_TEST_LAUNCHER=torchrun`` runs every job under it.
    """
    cmd, base = torchrun_command(nproc, *args)
    env = {**base, **(env or {})}
    if os.environ.get("RL2GEM_TEST_LAUNCHER") == "torchrun":
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env)
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    else:
        code, stdout, stderr = RankZygote.shared().run(nproc, args[0], args[1:], cwd or ROOT, env, timeout)
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    return stdout


class RankZygote:
    """A ``tests/rank_zygote.py`` fork server, one per test process (:meth:`shared`), started on first use."""

    _shared: "RankZygote | None" = None

    @classmethod
    def shared(cls) -> "RankZygote":
        if cls._shared is None or cls._shared.process.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def __init__(self):
        _, env = torchrun_command(1)
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "rank_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
            bufsize=1,
        )
        self._pending, self._exits = b"", {}
        assert "ready" in self._read(None)
        atexit.register(self.process.stdin.close)

    def run(self, nproc: int, script: str, args, cwd, env: dict, timeout: float) -> tuple[int, str, str]:
        """Run ``script args`` as ``nproc`` ranks; ``(exit code, stdout, stderr)`` as torchrun reports
        them: the ranks' outputs in rank order, the first failing rank's code, and the other ranks
        killed when one fails (or at ``timeout``, raising :class:`subprocess.TimeoutExpired`)."""
        port = free_port()
        with tempfile.TemporaryDirectory() as folder:
            pids = []
            for rank in range(nproc):
                rank_env = {
                    **env,
                    **{name: str(rank) for name in ("RANK", "LOCAL_RANK", "ROLE_RANK")},
                    **{name: str(nproc) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")},
                    "GROUP_RANK": "0",  # the node's rank
                    "GROUP_WORLD_SIZE": "1",
                    "ROLE_NAME": "default",
                    "MASTER_ADDR": "localhost",
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0",
                }
                request = {"script": str(script), "args": [str(a) for a in args], "cwd": str(cwd), "env": rank_env}
                request |= {stream: f"{folder}/{rank}.{stream}" for stream in ("stdout", "stderr")}
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                pids.append(self._next("pid"))
            codes = self._wait(pids, timeout)
            outputs = [
                "".join(Path(f"{folder}/{rank}.{stream}").read_text() for rank in range(nproc))
                for stream in ("stdout", "stderr")
            ]
        failed = [code for code in codes.values() if code != 0]  # in the order the ranks ended
        return (failed[0] if failed else 0), *outputs

    def _read(self, timeout: float | None) -> dict | None:
        """The server's next message, or None after ``timeout`` seconds without one."""
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            assert chunk, f"the rank fork server exited ({self.process.wait()})"
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _next(self, key: str) -> int:
        while "exited" in (message := self._read(None)):  # an exit before this pid: kept for _wait
            self._exits[message["exited"]] = message["code"]
        return message[key]

    def _wait(self, pids: list[int], timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {pid: self._exits.pop(pid) for pid in pids if pid in self._exits}
        while len(codes) < len(pids):
            late = time.monotonic() > deadline
            if late or any(code != 0 for code in codes.values()):
                for pid in set(pids) - set(codes):  # torchrun stops the other ranks when one fails
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
            message = self._read(1.0)
            if message is not None and message["exited"] in pids:
                codes[message["exited"]] = message["code"]
            if late and len(codes) == len(pids):
                raise subprocess.TimeoutExpired(f"ranks {pids}", timeout)
        return codes


def logged_steps(path, key: str) -> dict[int, dict]:
    """The last ``metrics.jsonl`` row holding ``key`` for each step (a resumed run logs again the steps
    after its checkpoint)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if key in row:
            rows[row["step"]] = row
    return rows


def masked_runs(ids, mask) -> list[list[int]]:
    """The token ids of each contiguous run where ``mask`` is set."""
    runs, current = [], []
    for token, on in zip(ids, mask, strict=True):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def stop_and_resume(nproc: int, script: str, args: list[str], stop: int, total: int, out) -> None:
    """Run ``script`` to step ``stop`` (its checkpoint), then again with ``trainer.resume=true`` to
    ``total`` in the same ``out`` folder; assert that the second run resumed at ``stop``."""
    torchrun(nproc, script, *args, f"trainer.total_steps={stop}", f"trainer.output_dir={out}")
    stdout = torchrun(
        nproc, script, *args, f"trainer.total_steps={total}", "trainer.resume=true", f"trainer.output_dir={out}"
    )
    assert f"resumed from step {stop}" in stdout


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, its output captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)


def grouped(seed=0, system=0):
    """Three GRPO-like groups (a prompt, three continuations) and one sequence of its own, the
    groups optionally under one shared system prompt."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    seqs, shared = [], rand(system)
    for _ in range(3):
        prompt = shared + rand(10)
        seqs += [prompt + rand(5), prompt + rand(7), prompt + rand(3)]
    return [*seqs, rand(6)]


def one_at_a_time(model, seqs):
    """Per-token log-probs and entropies of each sequence run on its own (no packing, no mask), in
    packed order with 0 at each first token, as token_logprobs returns them."""
    logprobs, entropies = [], []
    device = next(model.parameters()).device
    for seq in seqs:
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, :-1].float()
        log_softmax = torch.log_softmax(logits, -1)
        zero = logits.new_zeros(1)
        following = torch.tensor(seq[1:], device=device)[:, None]
        logprobs.append(torch.cat([zero, log_softmax.gather(1, following).squeeze(1)]))
        entropies.append(torch.cat([zero, -(log_softmax.exp() * log_softmax).sum(-1)]))
    return torch.cat(logprobs), torch.cat(entropies)


def _process_table() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, state, command line) of every process this user can see; the state of a
    fork server's child waiting for work (not yet sandboxed code) is ``"W"``."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                comm, _, rest = fh.read().partition(" (")[2].rpartition(")")
                fields = rest.split()
            state = "W" if comm == "sandbox-waiting" and fields[0] != "Z" else fields[0]
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                table[int(entry)] = (int(fields[1]), state, fh.read())
        except (OSError, IndexError, ValueError):
            pass
    return table


def _servers(table: dict[int, tuple[int, str, bytes]]) -> set[int]:
    # a forked child keeps its server's command line: a server is one whose parent is not a server
    zygote = b"_sandbox_zygote.py"
    return {
        pid
        for pid, (parent, _, cmd) in table.items()
        if zygote in cmd and zygote not in table.get(parent, (0, "", b""))[2]
    }


def fork_servers(parent: int | None = None) -> list[int]:
    """Live fork servers of the Python sandbox (``_sandbox_zygote.py`` processes, not their children),
    only those started by ``parent`` when given."""
    table = _process_table()
    return sorted(
        pid for pid in _servers(table) if table[pid][1] != "Z" and (parent is None or table[pid][0] == parent)
    )


def lasting_sandbox_pids(seconds: float = 2.0) -> list[int]:
    """:func:`sandbox_pids` once they have had ``seconds`` to exit: a sandboxed process that was
    just killed can still be listed (exiting, not yet a zombie) on a loaded machine; one that
    escaped (``sleep 100 &``) is still there after."""
    deadline = time.monotonic() + seconds
    while (pids := sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def sandbox_pids() -> list[int]:
    """Live (not zombie) sandboxed processes: interpreters running the boot script, and every
    descendant of a fork server (its children and anything they started), but not the servers
    nor their children still waiting for work, and not those of another test worker (a process
    descending from a sibling of this one: ``make test``'s other worker runs sandboxes of its own
    meanwhile). A boot interpreter re-parented to init (its parent gone) still counts."""
    table = _process_table()
    servers = _servers(table)
    others = {pid for pid, (parent, _, _) in table.items() if parent == os.getppid() and pid != os.getpid()}
    found = []
    for pid, (_, state, cmd) in table.items():
        if state in ("Z", "W") or pid in servers:
            continue
        lineage = [pid]  # the process and its ancestors
        while lineage[-1] in table and len(lineage) <= 64:
            lineage.append(table[lineage[-1]][0])
        if others.intersection(lineage):
            continue
        if b"_sandbox_boot.py" in cmd or servers.intersection(lineage[1:]):
            found.append(pid)
    return found


@contextlib.contextmanager
def serving(app: web.Application):
    """Serve the aiohttp ``app`` on a free loopback port from a thread with its own event loop (so a
    test can call it with blocking clients); yields its URL."""
    loop = asyncio.new_event_loop()
    runner = app_runner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def lean_bf16_errors(model, device) -> tuple[float, float]:
    """How far bf16 logits stray from the float32 forward's, on ``device``: the embedded engine's
    lean prefill and decode (:class:`rl2gem.rollout.engines.lean_decoder.LeanDecoder`) against
    transformers' own bf16 forward, each as its largest difference from ``model``'s float32
    logits over 4 staggered prompts (5 to 30 tokens), their prefill and 6 decode steps."""
    import copy

    from rl2gem.rollout.engines.embedded import _KVStore
    from rl2gem.rollout.engines.lean_decoder import LeanDecoder

    full, half = model.float().to(device), copy.deepcopy(model).to(device, torch.bfloat16)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(1)
    lengths, steps = [5, 9, 17, 30], 6
    sequences = [torch.randint(0, config.vocab_size, (n + steps,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        truth = [full(input_ids=torch.tensor([s], device=device)).logits[0].float() for s in sequences]
        own = [half(input_ids=torch.tensor([s], device=device)).logits[0].float() for s in sequences]
        store = _KVStore(config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.bfloat16, device)
        store.reserve(len(lengths), 0, 64)
        store.lo = store.hi = 0
        store.slots, end = len(lengths), max(lengths)
        for row, n in enumerate(lengths):
            store.mask[row, end - n : end] = True
        decoder = LeanDecoder(half)
        rows = [(row, s[:n], 0) for row, (s, n) in enumerate(zip(sequences, lengths, strict=True))]
        lean = [decoder.prefill(store, rows, end)]
        store.hi = end
        for step in range(steps):
            store.mask[:, store.hi] = True
            tokens = torch.tensor([s[n + step] for s, n in zip(sequences, lengths, strict=True)], device=device)
            positions = torch.tensor([n + step for n in lengths], device=device)
            lean.append(decoder.decode(store, tokens, positions, [n + step + 1 for n in lengths]))
            store.hi += 1

    def at(logits: list[torch.Tensor], step: int) -> torch.Tensor:  # each prompt's logits after step's token
        return torch.stack([row[n - 1 + step] for row, n in zip(logits, lengths, strict=True)])

    lean_error = max(float((got - at(truth, step)).abs().max()) for step, got in enumerate(lean))
    own_error = max(float((at(own, step) - at(truth, step)).abs().max()) for step in range(steps + 1))
    return lean_error, own_error


async def three_rows_then_one(engine, params: dict) -> tuple:
    """Three 20-token requests admitted together, then a 9-token one, on ``engine`` (closed
    after) with sampling ``params``. -> (the three outputs, the last one's, the engine's settled
    stats, its decode graphs)."""
    outs = await admitted_together(
        engine,
        [engine.generate(list(range(10 + i, 30 + i)), {**params, "max_new_tokens": 20}) for i in range(3)],
    )
    after = await engine.generate(list(range(50, 70)), {**params, "max_new_tokens": 9})
    stats = await engine.settled_stats()
    graphs = engine._graphs
    await engine.close()
    return outs, after, stats, graphs


async def admitted_together(engine, requests) -> list:
    """Run ``requests`` (coroutines of ``engine``'s ``generate`` or a stream's consumer) admitted
    in one prefill: queued while the engine is paused in place, then resumed. -> their results,
    in order."""
    await engine.pause("in_place")
    tasks = [asyncio.ensure_future(request) for request in requests]
    while len(engine._waiting) < len(tasks):
        await asyncio.sleep(0.005)
    await engine.resume()
    return await asyncio.gather(*tasks)
