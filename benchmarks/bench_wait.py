"""Benchmark: how fast an idle receiver wakes up, and what waiting costs, per receive wait.

Run it with ``python benchmarks/bench_wait.py`` (``--quick`` for a smoke run, ``--json PATH``
for the raw samples). A benchmark, not a test: it prints figures and asserts only that every
message arrived.

What is measured
================

Rank 0 sends one small message (64 B) after a gap (``--gaps``, default 1, 5, 20, 100 and
1000 ms) of silence, many times per gap (``--messages-s`` seconds of messages per gap and
mode, split over ``--rounds`` rounds; in each round every gap runs every mode in turn, the
order rotated per round, so that outside load lands on all modes alike); each receiver
takes ``time.monotonic()`` as soon as the message is in its hands and reports
``t_received - t_sent`` (the sender stamped ``t_sent`` into the message just before
sending; CLOCK_MONOTONIC is one clock for every process on a Linux machine, so this one-way
figure needs no ack). Reported per gap: the median, p90, p99 and maximum wake-up latency in
microseconds, over all receivers.

Then the idle cost: after one last message, the receivers wait ``--idle-seconds`` with
nothing sent; rank 0 samples their CPU time (psutil, user + system, all threads) at the start
and the end of the window and reports percent of one core per receiver.

Modes, all on the same gloo group of one run (``--world`` ranks on loopback):

``block``     ``BroadcastChannel(wait="block")``: inside gloo's blocking wait (the CPU path)
``backoff``   ``wait="poll", spin_s=0``: the polling wait as it was (20 us doubling to 5 ms)
``spin``      ``wait="poll"`` with the default ``SPIN_S``: after each step, look every
              ``POLL_MIN_S`` for ``SPIN_S``, then back off (the GPU default now); the
              benchmark's messages are steps (PAYLOAD frames)
``mq``        vLLM's shared-memory ``MessageQueue`` (``mp``'s transport): readers busy-poll
              for 1 s after their last read, then block on a ZMQ socket

On a GPU the polling wait polls an NCCL work object instead of a gloo one (``is_completed()``
is an event query); the schedule, and therefore the shape of these figures, is the same, but
the absolute figures there were not measured (no GPU here). The machine is shared: figures
are noisy, compare modes within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import struct
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_channel import MQTransport, _die_with_parent, wait_quiet  # noqa: E402

MODES = ("block", "backoff", "spin", "mq")
_STAMP = struct.Struct("<q")


def _channel(mode: str) -> Any:
    from keepalive_executor.channel import BroadcastChannel

    if mode == "block":
        return BroadcastChannel(None, src=0, inline_bytes=256, wait="block")
    if mode == "backoff":
        return BroadcastChannel(None, src=0, inline_bytes=256, wait="poll", spin_s=0.0)
    return BroadcastChannel(None, src=0, inline_bytes=256, wait="poll")


class Endpoint:
    """One mode's sender or receiver: ``send(bytes)`` / ``recv() -> bytes``."""

    def __init__(self, mode: str, rank: int, world: int) -> None:
        self.mode = mode
        if mode == "mq":
            self.mq = MQTransport(rank, world, 1 << 24)
        else:
            self.channel = _channel(mode)

    def send(self, data: bytes) -> None:
        if self.mode == "mq":
            self.mq.send(data)
        else:
            self.channel.send(data)

    def recv(self) -> bytes:
        if self.mode == "mq":
            return self.mq.mq.dequeue(indefinite=True)
        msg = self.channel.recv()
        return bytes(msg.data)

    def close(self) -> None:
        if self.mode == "mq":
            self.mq.close()
        elif self.channel.is_sender:
            self.channel.send_shutdown()
        else:
            self.channel.recv()  # SHUTDOWN


def _message() -> bytes:
    return _STAMP.pack(time.monotonic_ns()) + b"\0" * 56


def series(ep: Endpoint, rank: int, gap_ms: float, n: int) -> list[float]:
    """``n`` messages, each after ``gap_ms`` of silence; the receivers' latencies (us).
    The first message opens the series (the wait before it is not a gap) and is not
    counted."""
    samples: list[float] = []
    for i in range(n + 1):
        if rank == 0:
            time.sleep(gap_ms / 1000)
            ep.send(_message())
        else:
            data = ep.recv()
            now = time.monotonic_ns()
            if i > 0:
                samples.append((now - _STAMP.unpack_from(data)[0]) / 1000)
    return samples


def idle_cpu(ep: Endpoint, rank: int, pids: list[int], seconds: float) -> list[float] | None:
    """After one last step, the receivers' CPU over ``seconds`` (% of one core each)."""
    import psutil

    if rank != 0:
        ep.recv()
        ep.recv()
        return None
    procs = [psutil.Process(p) for p in pids[1:]]
    ep.send(_message())
    time.sleep(0.01)  # the receivers are in their next wait
    c0 = [sum(p.cpu_times()[:2]) for p in procs]
    w0 = time.monotonic()
    time.sleep(seconds)
    c1 = [sum(p.cpu_times()[:2]) for p in procs]
    wall = time.monotonic() - w0
    ep.send(_message())
    return [100 * (b - a) / wall for a, b in zip(c0, c1, strict=True)]


def run_all(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every rank, the same schedule: ``--rounds`` rounds; in each, every gap, and for each
    gap every mode in turn (the order rotated per round), so that a burst of outside load
    lands on all modes alike; then each mode's idle window."""
    import torch.distributed as dist

    eps = {mode: Endpoint(mode, rank, world) for mode in args.modes}
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    lat: dict[str, dict[str, list[float]]] = {m: {str(g): [] for g in args.gaps}
                                              for m in args.modes}
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
        for gap in args.gaps:
            n = max(2, round(args.messages_s / (gap / 1000) / args.rounds))
            for mode in order:
                got = series(eps[mode], rank, gap, n)
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, got)
                lat[mode][str(gap)] += [x for part in parts[1:] for x in part]
    idle = {mode: idle_cpu(eps[mode], rank, pids, args.idle_seconds) for mode in args.modes}
    for ep in eps.values():
        ep.close()
    dist.barrier()
    return {m: {"latency_us": lat[m], "idle_cpu_pct": idle[m]} for m in args.modes}


def rank_main(rank: int, world: int, args: argparse.Namespace, init_file: str,
              out_path: str) -> None:
    _die_with_parent()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))
        import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401

        results = run_all(rank, world, args)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    from keepalive_executor.channel import POLL_MAX_S, SPIN_S

    lines = [
        f"# receive wait: wake-up latency and idle CPU ({time.strftime('%Y-%m-%d %H:%M %Z')})",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; world {args.world} "
        f"({args.world - 1} receiver(s)), gloo on loopback; SPIN_S={SPIN_S * 1000:g} ms, "
        f"POLL_MAX_S={POLL_MAX_S * 1000:g} ms",
        f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}",
        "",
        "wake-up latency, us (median / p90 / p99 / max), by the gap before the message:",
        "",
        "| gap | " + " | ".join(args.modes) + " |",
        "|---" * (len(args.modes) + 1) + "|",
    ]
    for gap in args.gaps:
        row = [f"{gap:g} ms"]
        for mode in args.modes:
            s = results[mode]["latency_us"][str(gap)]
            row.append(f"{statistics.median(s):.0f} / {pct(s, .9):.0f} / {pct(s, .99):.0f} "
                       f"/ {max(s):.0f} (n={len(s)})")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"idle CPU over {args.idle_seconds:g} s after the last step, % of one core "
                  "per receiver:", ""]
    lines.append("| " + " | ".join(args.modes) + " |")
    lines.append("|---" * len(args.modes) + "|")
    lines.append("| " + " | ".join(
        ", ".join(f"{x:.1f}" for x in results[m]["idle_cpu_pct"]) for m in args.modes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gaps", type=float, nargs="+", default=[1, 5, 20, 100, 1000],
                   help="silence before each message, ms")
    p.add_argument("--messages-s", type=float, default=2.0,
                   help="seconds of messages per gap (at least 3 messages)")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--wait-quiet", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="short: 0.3 s per gap, 2 s idle")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.messages_s, args.idle_seconds, args.gaps, args.rounds = 0.3, 2.0, [1, 20, 200], 1
    wait_quiet(args.wait_quiet)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_wait_") as tmp:
        out = os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=rank_main, args=(r, args.world, args,
                                                     os.path.join(tmp, "init"), out))
                 for r in range(args.world)]
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(1800)
            if any(proc.exitcode != 0 for proc in procs):
                print(f"a rank failed: exit codes {[q.exitcode for q in procs]}",
                      file=sys.stderr)
                return 1
            with open(out) as f:
                results = json.load(f)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
    print(render(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
