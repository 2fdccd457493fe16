"""Benchmark: dispatch latency and idle CPU of BroadcastChannel vs. its two reference points.

Run it with ``python benchmarks/bench_channel.py`` (``--quick`` for a fast smoke run,
``--help`` for the knobs, ``--json PATH`` for the raw figures and samples). It is a benchmark,
not a test: it checks only that every message arrived with the right length, and prints
figures.

What is measured, and why
=========================

The executor's hot path is "the driver hands one message to every worker". Three transports
that can do that are compared in the same processes, on the same machine, in one run:

``bare``
    ``torch.distributed.broadcast`` of a preallocated ``uint8`` tensor of exactly the payload's
    size, on the default gloo group. This is the lower bound for anything built on gloo: one
    collective, no framing, no (de)serialization, no allocation.
``channel``
    ``keepalive_executor.channel.BroadcastChannel(None, src=0, inline_bytes=N)`` on the same
    default gloo group: ``send(payload_bytes)`` on rank 0, ``recv()`` on the others. It pickles
    the ``bytes`` object, broadcasts a fixed ``HEADER + inline`` frame, and, if the pickled
    payload exceeds the inline capacity, a second broadcast of the whole payload.
``mq``
    vLLM's shared-memory ``MessageQueue`` (``shm_broadcast.py``), the transport of vLLM's ``mp``
    executor: a ring buffer in ``/dev/shm`` plus zmq notifications, with
    ``max_chunk_bytes = VLLM_MQ_MAX_CHUNK_BYTES_MB`` as in ``multiproc_executor.py``. Readers
    busy-poll (``sched_yield``) for ``busy_loop_s`` = 1 s after their last read, then block on
    a zmq poll (woken by the writer, re-checking every 5 s).

Rank 0 is the sender; ranks 1..world-1 receive. The same ``bytes`` object of each size is sent
every time (64 B, 4 KiB, 64 KiB, 1 MiB by default).

Latency is a *ping round trip*, because one-way latency across processes cannot be timed with
one clock: rank 0 takes ``t0``, sends message *i*, then joins an ``all_reduce`` of one int64 on a
*separate* gloo group (``dist.new_group``) made only for acks; each receiver, as soon as it has
the message, joins that all_reduce contributing the number of bytes it received (rank 0 checks
the sum). Rank 0 takes ``t1`` when the all_reduce returns. Reported: median and p99 (nearest
rank) of ``t1 - t0`` in microseconds, after warm-up messages that are not timed. The timed
messages of each (transport, size) are split over ``--rounds`` rounds (default 3), and every
round runs all sizes and all transports in turn (transport order rotated per round), so a
burst of outside load or a slow drift lands on all transports alike. The ack is the
same for all three transports, so it cancels in a comparison of differences but *compresses
ratios towards 1*; the ack-only round trip (the all_reduce alone, nothing sent) is printed too,
and "RTT - ack" columns give a rough one-way estimate (rough: the ack of a ping overlaps
differently with the send than an ack-only round does).

Idle CPU: with receivers blocked waiting (``channel.recv()`` inside a gloo broadcast;
``MessageQueue.dequeue(indefinite=True)`` as the mp worker loop does) and the sender sending
nothing, rank 0 samples ``psutil.Process(pid).cpu_times()`` (user + system, all threads) of
every receiver at the start and end of the idle window, and also after its first
``--idle-first-seconds`` (default 2 s), where MessageQueue readers are still in their busy-poll
phase. Figures are percent of one core per receiver (mean over receivers, and each receiver)
and the total over receivers. Each idle window starts right after the receivers got (and
acked) one tiny message, i.e. the state of a worker right after the last step of a burst. The
gloo group timeout is well above the idle window, so no keepalive is needed or sent.

The machine may be shared: before each world size the benchmark waits (``--wait-quiet``, up
to 60 s) for other processes to go quiet, and it reports how much CPU other processes used
while each world size ran (machine-wide busy time minus the benchmark's own), so a
contaminated run is visible as such.

Processes are started with the ``spawn`` context; gloo is initialised with a ``file://`` store
and ``GLOO_SOCKET_IFNAME=lo``, so everything stays on loopback. On a machine with fewer cores
than ranks (world size 3 on 2 cores), results are oversubscribed: that is reported, not fixed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

KIB = 1024
MIB = 1024 * 1024
TRANSPORTS = ("bare", "channel", "mq")
TRANSPORT_LABEL = {
    "bare": "bare gloo broadcast",
    "channel": "BroadcastChannel",
    "mq": "vLLM shm MessageQueue",
}


# ------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Config:
    """Everything a rank needs to know; picklable so that spawned ranks get a copy."""

    sizes: tuple[int, ...]
    world_sizes: tuple[int, ...]
    inline_bytes: int
    warmup: int
    iters: int
    iters_large: int
    large_threshold: int
    idle_seconds: float
    idle_first_seconds: float
    group_timeout_s: float
    world_timeout_s: float
    mq_max_chunk_bytes: int
    rounds: int
    rewarm: int

    def iters_for(self, size: int) -> int:
        """Timed messages at ``size`` bytes."""
        return self.iters_large if size >= self.large_threshold else self.iters


def parse_size(text: str) -> int:
    """Parse ``64``, ``4k``, ``4KiB``, ``1m``, ``1MiB`` into a byte count."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t.endswith("k"):
        mult, t = KIB, t[:-1]
    elif t.endswith("m"):
        mult, t = MIB, t[:-1]
    value = int(float(t) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def fmt_size(n: int) -> str:
    """64 B, 4 KiB, 1 MiB, ..."""
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


# ---------------------------------------------------------------------------- transports
class Transport:
    """One sender (rank 0), world-1 receivers. ``recv`` returns the received byte count."""

    name = "?"

    def prepare(self, size: int, payload: bytes | None) -> None:
        """Called on every rank before the messages of one size (payload on rank 0 only)."""

    def send(self, payload: bytes) -> None:
        raise NotImplementedError

    def recv(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Collective teardown."""


class BareBroadcast(Transport):
    """One ``dist.broadcast`` of a preallocated uint8 tensor of the payload's size."""

    name = "bare"

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def prepare(self, size: int, payload: bytes | None) -> None:
        if self.rank == 0:
            assert payload is not None and len(payload) == size
            self.tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            self.tensor = torch.empty(size, dtype=torch.uint8)

    def send(self, payload: bytes) -> None:
        # The tensor already holds these bytes: this is the one-collective lower bound.
        import torch.distributed as dist

        dist.broadcast(self.tensor, src=0)

    def recv(self) -> int:
        import torch.distributed as dist

        dist.broadcast(self.tensor, src=0)
        return self.tensor.numel()


class ChannelTransport(Transport):
    """The project's BroadcastChannel on the default group."""

    name = "channel"

    def __init__(self, inline_bytes: int) -> None:
        from keepalive_executor.channel import BroadcastChannel

        self.channel = BroadcastChannel(None, src=0, inline_bytes=inline_bytes)

    def send(self, payload: bytes) -> None:
        self.channel.send(payload)

    def recv(self) -> int:
        from keepalive_executor.channel import MessageKind

        msg = self.channel.recv()
        if msg.kind is not MessageKind.PAYLOAD:
            raise RuntimeError(f"unexpected {msg.kind.name} frame (seq {msg.seq})")
        return len(msg.payload)


class MQTransport(Transport):
    """vLLM's shm MessageQueue: rank 0 writes, ranks 1.. are its local readers."""

    name = "mq"

    def __init__(self, rank: int, world: int, max_chunk_bytes: int) -> None:
        import torch.distributed as dist
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        self.rank = rank
        readers = list(range(1, world))
        if rank == 0:
            self.mq = MessageQueue(
                n_reader=len(readers),
                n_local_reader=len(readers),
                local_reader_ranks=readers,
                max_chunk_bytes=max_chunk_bytes,
            )
            box: list[Any] = [self.mq.export_handle()]
            dist.broadcast_object_list(box, src=0)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            self.mq = MessageQueue.create_from_handle(box[0], rank)
        self.mq.wait_until_ready()

    def send(self, payload: bytes) -> None:
        self.mq.enqueue(payload)

    def recv(self) -> int:
        return len(self.mq.dequeue(indefinite=True))

    def close(self) -> None:
        import torch.distributed as dist

        # Readers detach first; the writer (creator) unlinks the shm segment last.
        if self.rank != 0:
            del self.mq
            gc.collect()
        dist.barrier()
        if self.rank == 0:
            del self.mq
            gc.collect()


# ---------------------------------------------------------------------------- rank side
def summarize(samples: list[float]) -> dict[str, float]:
    """median / p99 (nearest rank) / mean / min / max of microsecond samples."""
    s = sorted(samples)
    n = len(s)
    return {
        "n": n,
        "median_us": statistics.median(s),
        "p99_us": s[max(0, math.ceil(0.99 * n) - 1)],
        "mean_us": statistics.fmean(s),
        "min_us": s[0],
        "max_us": s[-1],
    }


def _cpu_seconds(procs: list[Any]) -> list[float]:
    out = []
    for p in procs:
        t = p.cpu_times()
        out.append(t.user + t.system)
    return out


class RankBench:
    """The schedule every rank runs, in the same order, for one world size."""

    def __init__(self, rank: int, world: int, cfg: Config, ack_group: Any) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world = world
        self.cfg = cfg
        self.ack_group = ack_group
        self.is_sender = rank == 0
        self._ack_buf = torch.zeros(1, dtype=torch.int64)
        pids: list[Any] = [None] * world
        dist.all_gather_object(pids, os.getpid())
        self.pids = [int(p) for p in pids]
        self.payloads = {s: os.urandom(s) for s in cfg.sizes} if self.is_sender else {}

    def ack(self, value: int) -> int:
        """The ack every transport shares: a one-int64 all_reduce on the ack-only group."""
        import torch.distributed as dist

        self._ack_buf[0] = value
        dist.all_reduce(self._ack_buf, group=self.ack_group)
        return int(self._ack_buf[0])

    def ack_only(self, n_warm: int, n_meas: int) -> list[float]:
        """Round trips of the ack alone (nothing sent): the floor under every RTT below."""
        samples: list[float] = []
        for i in range(n_warm + n_meas):
            t0 = time.perf_counter_ns()
            self.ack(0)
            t1 = time.perf_counter_ns()
            if i >= n_warm:
                samples.append((t1 - t0) / 1000)
        return samples if self.is_sender else []

    def pings(self, tr: Transport, size: int, n_warm: int, n_meas: int) -> list[float]:
        """``n_warm`` untimed + ``n_meas`` timed pings of ``size`` bytes (samples on rank 0)."""
        payload = self.payloads.get(size)
        tr.prepare(size, payload)
        if not self.is_sender:
            for _ in range(n_warm + n_meas):
                self.ack(tr.recv())
            return []
        assert payload is not None
        expect = (self.world - 1) * size
        samples: list[float] = []
        for i in range(n_warm + n_meas):
            t0 = time.perf_counter_ns()
            tr.send(payload)
            got = self.ack(0)
            t1 = time.perf_counter_ns()
            if got != expect:
                raise RuntimeError(
                    f"{tr.name} {size} B message {i}: receivers acked {got} bytes, "
                    f"expected {expect}"
                )
            if i >= n_warm:
                samples.append((t1 - t0) / 1000)
        return samples

    def idle(self, tr: Transport) -> dict[str, Any] | None:
        """CPU of receivers blocked in ``tr.recv()`` while rank 0 sends nothing."""
        marker = b"idle"
        if not self.is_sender:
            for _ in range(2):  # the message that opens the window, the one that closes it
                self.ack(tr.recv())
            return None
        import psutil

        procs = [psutil.Process(pid) for pid in self.pids[1:]]
        tr.send(marker)
        self.ack(0)
        c0, w0 = _cpu_seconds(procs), time.monotonic()
        first = min(self.cfg.idle_first_seconds, self.cfg.idle_seconds)
        time.sleep(first)
        c1, w1 = _cpu_seconds(procs), time.monotonic()
        time.sleep(max(0.0, self.cfg.idle_seconds - first))
        c2, w2 = _cpu_seconds(procs), time.monotonic()
        tr.send(marker)
        got = self.ack(0)
        if got != (self.world - 1) * len(marker):
            raise RuntimeError(f"{tr.name} idle: receivers acked {got} bytes")

        def pct(a: list[float], b: list[float], wall: float) -> list[float]:
            return [100.0 * (y - x) / wall for x, y in zip(a, b, strict=True)]

        whole = pct(c0, c2, w2 - w0)
        head = pct(c0, c1, w1 - w0)
        tail = pct(c1, c2, w2 - w1) if w2 - w1 > 0.05 else []
        return {
            "window_s": w2 - w0,
            "first_window_s": w1 - w0,
            "per_receiver_pct": whole,
            "mean_pct": statistics.fmean(whole),
            "total_pct": sum(whole),
            "first_per_receiver_pct": head,
            "first_mean_pct": statistics.fmean(head),
            "rest_per_receiver_pct": tail,
            "rest_mean_pct": statistics.fmean(tail) if tail else None,
            "cpu_seconds_whole": [y - x for x, y in zip(c0, c2, strict=True)],
        }

    def run(self) -> dict[str, Any]:
        """The fixed schedule (identical on every rank).

        Latency runs in ``rounds`` rounds; each round times the ack alone, then for every
        size every transport (order rotated per round) with its share of the messages, so
        that a burst of outside load or a slow drift hits all transports alike. Round 0
        warms each (transport, size) up with ``warmup`` messages, later rounds with
        ``rewarm``. Then the idle-CPU windows: channel, then MessageQueue.
        """
        cfg = self.cfg
        trs: dict[str, Transport] = {}
        trs["bare"] = BareBroadcast(self.rank)
        trs["channel"] = ChannelTransport(cfg.inline_bytes)
        trs["mq"] = MQTransport(self.rank, self.world, cfg.mq_max_chunk_bytes)
        ack_samples: list[float] = []
        lat: dict[str, dict[int, list[float]]] = {t: {s: [] for s in cfg.sizes}
                                                  for t in TRANSPORTS}
        for r in range(cfg.rounds):
            warm = cfg.warmup if r == 0 else min(cfg.warmup, cfg.rewarm)
            ack_samples += self.ack_only(warm, share(cfg.iters, cfg.rounds, r))
            order = TRANSPORTS[r % len(TRANSPORTS):] + TRANSPORTS[: r % len(TRANSPORTS)]
            for size in cfg.sizes:
                n = share(cfg.iters_for(size), cfg.rounds, r)
                for name in order:
                    lat[name][size] += self.pings(trs[name], size, warm, n)
        idle: dict[str, Any] = {}
        if cfg.idle_seconds > 0:
            for name in ("channel", "mq"):
                idle[name] = self.idle(trs[name])
        # Collective teardown, on success only: after an error the rank exits at once
        # (rank_main), and a barrier here would only hang the others.
        for tr in trs.values():
            tr.close()
        if not self.is_sender:
            return {}
        return {
            "world": self.world,
            "pids": self.pids,
            "ack_only": {"summary": summarize(ack_samples), "samples_us": ack_samples},
            "latency": {
                t: {str(s): {"summary": summarize(v), "samples_us": v} for s, v in d.items()}
                for t, d in lat.items()
            },
            "idle": idle,
        }


def share(total: int, rounds: int, r: int) -> int:
    """Round ``r``'s share of ``total`` messages split over ``rounds`` rounds."""
    return total // rounds + (1 if r < total % rounds else 0)


def _die_with_parent() -> None:
    """Make sure a rank never outlives the benchmark (a reader blocked in
    ``dequeue(indefinite=True)`` would otherwise wait forever if the parent were killed)."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_main(rank: int, world: int, cfg: Config, init_file: str, result_path: str) -> None:
    """Entry point of one spawned rank."""
    _die_with_parent()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch.distributed as dist

    timeout = timedelta(seconds=cfg.group_timeout_s)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        ack_group = dist.new_group(ranks=list(range(world)), backend="gloo", timeout=timeout)
        # Import vLLM's MessageQueue before anything is timed (it is slow to import).
        import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401

        dist.barrier()
        result = RankBench(rank, world, cfg, ack_group).run()
        dist.barrier()
        if rank == 0:
            tmp = result_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, result_path)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# -------------------------------------------------------------------------- parent side
def _busy_cpu_seconds() -> float:
    """Machine-wide non-idle CPU seconds so far (all cores, excluding steal and iowait)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def _own_cpu_seconds() -> float:
    """CPU seconds of this process plus its reaped children (the benchmark's ranks)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadProbe:
    """CPU used by *other* processes on the machine while a world size runs."""

    def __init__(self) -> None:
        self.wall0 = time.monotonic()
        self.busy0 = _busy_cpu_seconds()
        self.own0 = _own_cpu_seconds()
        self.load0 = os.getloadavg()

    def finish(self) -> dict[str, Any]:
        """Call after the ranks were reaped (so that their CPU is in children_*)."""
        wall = time.monotonic() - self.wall0
        busy = _busy_cpu_seconds() - self.busy0
        own = _own_cpu_seconds() - self.own0
        other = max(0.0, busy - own)
        return {
            "wall_s": wall,
            "benchmark_cpu_s": own,
            "other_cpu_s": other,
            "other_pct_of_one_core": 100.0 * other / wall if wall > 0 else 0.0,
            "loadavg_1m_start": self.load0[0],
            "loadavg_1m_end": os.getloadavg()[0],
        }


def wait_quiet(max_wait_s: float, threshold_pct: float = 20.0, window_s: float = 3.0) -> float:
    """Wait until other processes used < threshold_pct of one core over window_s.

    Gives up after max_wait_s; returns the seconds waited. This machine may be shared (the
    figures are only meaningful when nothing else runs); what was seen is reported anyway.
    """
    t0 = time.monotonic()
    announced = False
    while True:
        b0, o0, w0 = _busy_cpu_seconds(), _own_cpu_seconds(), time.monotonic()
        time.sleep(window_s)
        other = (_busy_cpu_seconds() - b0) - (_own_cpu_seconds() - o0)
        pct = 100.0 * other / (time.monotonic() - w0)
        waited = time.monotonic() - t0
        if pct < threshold_pct or waited >= max_wait_s:
            return waited
        if not announced:
            print(f"... other processes use {pct:.0f}% of a core; waiting up to "
                  f"{max_wait_s:.0f} s for the machine to go quiet", file=sys.stderr, flush=True)
            announced = True


def run_world(world: int, cfg: Config) -> dict[str, Any]:
    """Spawn ``world`` ranks, wait for them, return rank 0's figures. Always reaps children."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_channel_") as tmp:
        init_file = os.path.join(tmp, "gloo_init")
        result_path = os.path.join(tmp, "result.json")
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, world, cfg, init_file, result_path),
                name=f"bench-channel-w{world}-r{r}",
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + cfg.world_timeout_s
            pending = list(procs)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"world size {world}: ranks still running after "
                                       f"{cfg.world_timeout_s:.0f} s")
                multiprocessing.connection.wait([p.sentinel for p in pending], timeout=left)
                for p in list(pending):
                    if p.exitcode is None:
                        continue
                    pending.remove(p)
                    if p.exitcode != 0:
                        raise RuntimeError(f"{p.name} exited with code {p.exitcode}")
            with open(result_path) as f:
                return json.load(f)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():  # should not happen after SIGKILL; report, do not hang
                    print(f"warning: {p.name} (pid {p.pid}) did not exit", file=sys.stderr)


def channel_frames(size: int, inline_bytes: int) -> int:
    """How many broadcasts BroadcastChannel.send issues for a ``size``-byte bytes object."""
    from keepalive_executor.channel import serialize

    return 1 if len(serialize(bytes(size))) <= inline_bytes else 2


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "n/a"
    return f"{a / b:.2f}x"


def render(results: dict[int, dict[str, Any]], cfg: Config, header: list[str]) -> str:
    """The plain-text (markdown) report."""
    lines = list(header)
    lines.append("")
    lines.append("## Dispatch latency: ping round trip, microseconds")
    lines.append("")
    lines.append(
        "RTT = rank 0 timing send(message) + a one-int64 gloo all_reduce ack (separate group) "
        "that each receiver joins right after it has the message; same ack for all transports. "
        "med = median, p99 = nearest-rank 99th percentile "
        f"(n = {cfg.iters} timed messages per cell, {cfg.iters_large} at >= "
        f"{fmt_size(cfg.large_threshold)}; with n < 100, p99 is the maximum). The messages "
        f"of a cell are split over {cfg.rounds} rounds that interleave all transports and "
        f"sizes; {cfg.warmup} untimed warm-up messages per cell in round 1, {cfg.rewarm} in "
        "later rounds. ch = broadcasts per BroadcastChannel message."
    )
    lines.append("")
    lines.append(
        "| world | payload | ch | bare med | bare p99 | channel med | channel p99 "
        "| MQ med | MQ p99 | channel/bare med | channel/bare p99 | channel/MQ med |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world, res in results.items():
        lat = res["latency"]
        for size in cfg.sizes:
            k = str(size)
            b, c, m = (lat[t][k]["summary"] for t in TRANSPORTS)
            lines.append(
                f"| {world} | {fmt_size(size)} | {channel_frames(size, cfg.inline_bytes)} "
                f"| {_f(b['median_us'])} | {_f(b['p99_us'])} "
                f"| {_f(c['median_us'])} | {_f(c['p99_us'])} "
                f"| {_f(m['median_us'])} | {_f(m['p99_us'])} "
                f"| {_ratio(c['median_us'], b['median_us'])} "
                f"| {_ratio(c['p99_us'], b['p99_us'])} "
                f"| {_ratio(c['median_us'], m['median_us'])} |"
            )
    lines.append("")
    lines.append("Ack-only round trip (the all_reduce alone, nothing sent; timed at the start "
                 "of every round), microseconds:")
    lines.append("")
    lines.append("| world | ack med | ack p99 |")
    lines.append("|---|---|---|")
    for world, res in results.items():
        a = res["ack_only"]["summary"]
        lines.append(f"| {world} | {_f(a['median_us'])} | {_f(a['p99_us'])} |")
    lines.append("")
    lines.append("## Rough one-way estimate: median RTT minus median ack-only RTT, microseconds")
    lines.append("")
    lines.append("| world | payload | bare | channel | MQ | channel/bare | channel/MQ |")
    lines.append("|---|---|---|---|---|---|---|")
    for world, res in results.items():
        ack = res["ack_only"]["summary"]["median_us"]
        for size in cfg.sizes:
            k = str(size)
            b, c, m = (res["latency"][t][k]["summary"]["median_us"] - ack for t in TRANSPORTS)
            lines.append(
                f"| {world} | {fmt_size(size)} | {_f(b)} | {_f(c)} | {_f(m)} "
                f"| {_ratio(c, b)} | {_ratio(c, m)} |"
            )
    if 4 * KIB in cfg.sizes:
        lines.append("")
        lines.append("Aim: channel within 1.2x of a bare broadcast at 4 KiB (median RTT):")
        for world, res in results.items():
            b, c = (res["latency"][t][str(4 * KIB)]["summary"]["median_us"] for t in
                    ("bare", "channel"))
            verdict = "met" if c <= 1.2 * b else "NOT met"
            lines.append(f"- world {world}: {c / b:.2f}x -> {verdict}")
    if cfg.idle_seconds > 0:
        lines.append("")
        lines.append("## CPU of waiting receivers, sender idle, percent of one core")
        lines.append("")
        first = min(cfg.idle_first_seconds, cfg.idle_seconds)
        lines.append(
            f"Receivers blocked in channel.recv() / MessageQueue.dequeue(indefinite=True) for "
            f"{cfg.idle_seconds:g} s after one tiny message; psutil cpu_times (user+system, all "
            f"threads) of each receiver at start, after {first:g} s, and at end. "
            "mean = per receiver (mean over receivers); total = sum over receivers."
        )
        lines.append("")
        lines.append(
            "| world | transport | window s | mean % (whole) | total % (whole) "
            f"| each receiver % (whole) | mean % (first {first:g} s) | mean % (rest) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for world, res in results.items():
            for name in ("channel", "mq"):
                d = res["idle"].get(name)
                if not d:
                    continue
                each = ", ".join(f"{x:.1f}" for x in d["per_receiver_pct"])
                lines.append(
                    f"| {world} | {TRANSPORT_LABEL[name]} | {d['window_s']:.1f} "
                    f"| {d['mean_pct']:.2f} | {d['total_pct']:.2f} | {each} "
                    f"| {d['first_mean_pct']:.2f} | {_f(d['rest_mean_pct'], 2)} |"
                )
    lines.append("")
    lines.append("## Machine load while each world size ran")
    lines.append("")
    lines.append("| world | wall s | benchmark CPU s | other processes CPU s "
                 "| other, % of one core | loadavg 1m start -> end | waited for quiet s |")
    lines.append("|---|---|---|---|---|---|---|")
    for world, res in results.items():
        m = res.get("machine")
        if not m:
            continue
        lines.append(
            f"| {world} | {m['wall_s']:.0f} | {m['benchmark_cpu_s']:.1f} "
            f"| {m['other_cpu_s']:.1f} | {m['other_pct_of_one_core']:.0f} "
            f"| {m['loadavg_1m_start']:.2f} -> {m['loadavg_1m_end']:.2f} "
            f"| {_f(m['waited_for_quiet'], 0)} |"
        )
    return "\n".join(lines)


def header_lines(cfg: Config, argv: list[str]) -> list[str]:
    """Provenance: date, machine, versions, exact command."""
    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = "not installed"
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    date = time.strftime("%a %b %e %H:%M:%S UTC %Y", time.gmtime())
    cmd = shlex.join([sys.executable, *argv])
    over = [w for w in cfg.world_sizes if nproc is not None and w > nproc]
    lines = [
        "# bench_channel: BroadcastChannel vs bare gloo broadcast vs vLLM shm MessageQueue",
        "",
        f"date: {date} | uname -m: {platform.machine()} | nproc: {nproc} | "
        f"python {platform.python_version()} | torch {torch.__version__} | vllm {vllm_version}",
        f"command: {cmd}",
        f"cwd: {os.getcwd()}",
        f"settings: inline_bytes={cfg.inline_bytes} | warmup={cfg.warmup} | iters={cfg.iters} | "
        f"iters_large={cfg.iters_large} (sizes >= {fmt_size(cfg.large_threshold)}) | "
        f"idle={cfg.idle_seconds:g} s | gloo timeout={cfg.group_timeout_s:g} s | "
        f"MQ max_chunk_bytes={cfg.mq_max_chunk_bytes} | GLOO_SOCKET_IFNAME=lo, file:// init, "
        "spawn",
        "world = processes: rank 0 sends, the other world-1 ranks receive.",
    ]
    if over:
        lines.append(
            f"note: world size(s) {over} exceed nproc={nproc}: those runs are oversubscribed "
            "(MessageQueue readers busy-poll, competing with the sender for cores)."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run every world size, print the report, optionally write JSON."""
    argv = sys.argv[1:] if argv is None else argv
    from keepalive_executor.channel import DEFAULT_INLINE_BYTES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[64, 4 * KIB, 64 * KIB, MIB],
                   help="payload sizes (e.g. 64 4k 64k 1m)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--inline-bytes", type=int, default=DEFAULT_INLINE_BYTES,
                   help="BroadcastChannel inline capacity")
    p.add_argument("--warmup", type=int, default=50, help="untimed messages per size")
    p.add_argument("--iters", type=int, default=300, help="timed messages per small size")
    p.add_argument("--iters-large", type=int, default=50,
                   help="timed messages per size >= --large-threshold")
    p.add_argument("--large-threshold", type=parse_size, default=MIB)
    p.add_argument("--rounds", type=int, default=3,
                   help="split the timed messages over this many interleaved rounds")
    p.add_argument("--rewarm", type=int, default=10,
                   help="untimed messages per (transport, size) in rounds after the first")
    p.add_argument("--idle-seconds", type=float, default=20.0,
                   help="idle window for the CPU measurement (0 skips it)")
    p.add_argument("--idle-first-seconds", type=float, default=2.0,
                   help="leading part of the idle window reported separately")
    p.add_argument("--group-timeout", type=float, default=None,
                   help="gloo group timeout, s (default: max(120, 3 x idle + 60))")
    p.add_argument("--world-timeout", type=float, default=900.0,
                   help="kill a world size's ranks if they run longer than this, s")
    p.add_argument("--wait-quiet", type=float, default=60.0, metavar="SECONDS",
                   help="before each world size, wait up to this long for other processes "
                   "to use < 20%% of one core (0: do not wait); the load is reported either way")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: warmup 10, iters 30, iters-large 9, idle 3 s, no waiting")
    p.add_argument("--json", metavar="PATH", help="write the raw figures (and samples) here")
    a = p.parse_args(argv)

    if a.quick:
        a.warmup, a.iters, a.iters_large, a.idle_seconds = 10, 30, 9, 3.0
        a.wait_quiet = 0.0
    if a.rounds < 1 or a.iters < a.rounds or a.iters_large < a.rounds:
        p.error("need rounds >= 1 and iters, iters-large >= rounds")
    if a.warmup < 0 or a.rewarm < 0 or a.idle_seconds < 0:
        p.error("need warmup, rewarm, idle-seconds >= 0")
    if any(w < 2 for w in a.world_sizes):
        p.error("world sizes must be >= 2 (one sender, at least one receiver)")
    group_timeout = a.group_timeout or max(120.0, 3 * a.idle_seconds + 60)
    if group_timeout <= a.idle_seconds + 10:
        p.error("--group-timeout must be well above --idle-seconds (no keepalive is sent)")

    # SIGTERM -> SystemExit, so that run_world's cleanup (kill + reap the ranks) runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # inherited by the spawned ranks
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm.envs as vllm_envs

    cfg = Config(
        sizes=tuple(a.sizes),
        world_sizes=tuple(a.world_sizes),
        inline_bytes=a.inline_bytes,
        warmup=a.warmup,
        iters=a.iters,
        iters_large=a.iters_large,
        large_threshold=a.large_threshold,
        idle_seconds=a.idle_seconds,
        idle_first_seconds=a.idle_first_seconds,
        group_timeout_s=group_timeout,
        world_timeout_s=a.world_timeout,
        mq_max_chunk_bytes=vllm_envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * MIB,
        rounds=a.rounds,
        rewarm=a.rewarm,
    )
    header = header_lines(cfg, [sys.argv[0], *argv])
    started = time.monotonic()
    results: dict[int, dict[str, Any]] = {}
    for world in cfg.world_sizes:
        waited = wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
        print(f"... world size {world}", file=sys.stderr, flush=True)
        probe = LoadProbe()
        results[world] = run_world(world, cfg)
        results[world]["machine"] = {**probe.finish(), "waited_for_quiet": waited}
    report = render(results, cfg, header)
    report += f"\n\n(total benchmark wall time: {time.monotonic() - started:.0f} s)"
    print(report, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"header": header, "config": asdict(cfg),
                 "results": {str(w): r for w, r in results.items()}},
                f, indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
