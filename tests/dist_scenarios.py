"""Scenarios run in real processes on a real gloo group over loopback (spawned by tests).

Each scenario is ``fn(rank, world, result_queue, **kw)``; it puts one ``(rank, dict)`` on the
queue. Helpers here are imported by spawned children, so keep them import-light.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any


def init_group(rank: int, world: int, store_path: str, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def entry(scenario: str, rank: int, world: int, queue: Any, store_path: str,
          timeout_s: float, kw: dict) -> None:
    try:
        if kw.pop("joins_groups", False):  # the scenario joins the groups itself
            result = globals()[scenario](rank, world, store_path=store_path, **kw)
        else:
            init_group(rank, world, store_path, timeout_s)
            result = globals()[scenario](rank, world, **kw)
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        result = {"error": f"{type(e).__name__}: {e}", "error_type": type(e).__name__,
                  "traceback": traceback.format_exc()}
    result["t_end"] = time.monotonic()
    queue.put((rank, result))
    queue.close()
    queue.join_thread()  # flush before the hard exit below
    os._exit(0)


def _receive_all(channel) -> dict:
    from keepalive_executor.channel import ChannelError, MessageKind
    from keepalive_executor.rpc import deserialize

    log: list[tuple[int, Any]] = []
    keepalives = 0
    t_first = None
    try:
        while True:
            msg = channel.recv()
            if t_first is None:
                t_first = time.monotonic()
            if msg.kind is MessageKind.KEEPALIVE:
                keepalives += 1
            elif msg.kind is MessageKind.SHUTDOWN:
                return {"log": log, "keepalives": keepalives, "shutdown_seq": msg.seq}
            else:
                log.append((msg.seq, deserialize(msg.data)))
    except ChannelError as e:
        return {"log": log, "keepalives": keepalives, "error": str(e),
                "error_type": type(e).__name__, "t_error": time.monotonic(), "t_first": t_first}


def idle_survival(rank: int, world: int, idle_s: float, interval_s: float | None,
                  wait: str = "block") -> dict:
    """Driver: one message, ``idle_s`` of silence (paced or not), one message, shutdown.
    ``wait``: how receivers wait (``poll`` is the GPU path's sleeping wait, here on gloo)."""
    from keepalive_executor.channel import BroadcastChannel
    from keepalive_executor.pacer import Pacer
    from keepalive_executor.rpc import serialize

    channel = BroadcastChannel(None, src=0, inline_bytes=256, wait=wait)
    if rank != 0:
        return _receive_all(channel)
    pacer = None
    if interval_s is not None:
        pacer = Pacer(interval_s, channel.send_keepalive, send_lock=channel.send_lock)
        pacer.start()
    out: dict = {}
    try:
        channel.send(serialize("before"))
        time.sleep(idle_s)
        channel.send(serialize("after"))
        if pacer is not None:
            pacer.stop()
            out["keepalives_sent"] = pacer.keepalives_sent
        channel.send_shutdown()
    except Exception as e:  # noqa: BLE001
        out.update(error=str(e), error_type=type(e).__name__)
    if pacer is not None:
        pacer.stop()
    return out


def concurrent_senders(rank: int, world: int, threads: int, per_thread: int) -> dict:
    """Driver: several threads send while a fast pacer runs; everyone logs by sequence."""
    from keepalive_executor.channel import BroadcastChannel
    from keepalive_executor.pacer import Pacer
    from keepalive_executor.rpc import serialize

    channel = BroadcastChannel(None, src=0, inline_bytes=64)
    if rank != 0:
        return _receive_all(channel)
    pacer = Pacer(0.005, channel.send_keepalive, send_lock=channel.send_lock)
    pacer.start()
    sent: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def sender(t: int) -> None:
        for i in range(per_thread):
            # alternate small (inline) and large (two-collective) payloads
            payload = (t, i, b"x" * (200 if i % 3 == 0 else 8))
            seq = channel.send(serialize(payload))
            with lock:
                sent.append((seq, payload))

    ts = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    pacer.stop()
    seq = channel.send_shutdown()
    return {"sent": sorted(sent), "keepalives_sent": pacer.keepalives_sent, "shutdown_seq": seq}


def driver_dies(rank: int, world: int, after_s: float) -> dict:
    """Driver exits abruptly while receivers wait in the broadcast."""
    from keepalive_executor.channel import BroadcastChannel
    from keepalive_executor.rpc import serialize

    channel = BroadcastChannel(None, src=0)
    if rank != 0:
        return _receive_all(channel)
    channel.send(serialize("hello"))
    time.sleep(after_s)
    os._exit(17)


def receiver_dies(rank: int, world: int, victim: int) -> dict:
    """One receiver exits abruptly; the driver keeps sending until it notices."""
    from keepalive_executor.channel import BroadcastChannel, ChannelError
    from keepalive_executor.rpc import serialize

    channel = BroadcastChannel(None, src=0)
    if rank == victim:
        channel.recv()
        os._exit(9)
    if rank != 0:
        return _receive_all(channel)
    channel.send(serialize("first"))
    t_victim_gone = time.monotonic()
    sends = 0
    try:
        while time.monotonic() - t_victim_gone < 60:
            channel.send(serialize(b"y" * 10))
            sends += 1
            time.sleep(0.01)
        return {"error": None, "sends": sends}
    except ChannelError as e:
        return {"error": str(e), "error_type": type(e).__name__, "sends": sends,
                "t_error": time.monotonic(), "t_victim_gone": t_victim_gone}


def late_reply_gather(rank: int, world: int, late_s: float, rpc_timeout_s: float | None = None
                      ) -> dict:
    """A collective_rpc's reply gather in which the last rank finishes the call ``late_s``
    after the others (rank 0 waits at most ``rpc_timeout_s``, as its step would)."""
    import torch.distributed as dist

    from keepalive_executor.rpc import RpcReply, gather_replies

    if rank == world - 1:
        time.sleep(late_s)
    start = time.monotonic()
    replies = gather_replies(RpcReply(rank=rank, ok=True, value=rank), dist.group.WORLD, dst=0,
                             world_size=world, timeout_s=rpc_timeout_s if rank == 0 else None)
    return {"values": None if replies is None else [r.value for r in replies],
            "waited_s": time.monotonic() - start}



def startup_timeouts_on_vllms_groups(rank: int, world: int, store_path: str, user_s: int,
                                     startup_s: float | None, late_s: float) -> dict:
    """vLLM's own groups (``init_distributed_environment`` and ``initialize_model_parallel``
    as a worker's ``init_device`` makes them; the default group is the scenario runner's)
    created inside ``startup_timeouts.during_startup`` with both timeouts USER_S and the
    start-up timeout STARTUP_S (None: not raised). Rank 1 reaches a barrier on the TP CPU group
    and an all-reduce on the TP device group LATE_S after rank 0; then every rank restores
    the groups' timeouts and the same happens again. Rank 0 reports how each wait ended."""
    import torch
    import torch.distributed as dist
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from keepalive_executor import startup_timeouts

    pc = ParallelConfig(distributed_timeout_seconds=user_s, cpu_distributed_timeout_seconds=user_s)
    out: dict[str, Any] = {}
    with set_current_vllm_config(VllmConfig(parallel_config=pc)):
        with startup_timeouts.during_startup(pc, startup_s) as raised:
            ps.init_distributed_environment(world, rank, f"file://{store_path}", rank, "gloo")
            ps.initialize_model_parallel(tensor_model_parallel_size=world)
        out["raised"] = raised
        out["config_after"] = [pc.distributed_timeout_seconds, pc.cpu_distributed_timeout_seconds]
        tp = ps.get_tp_group()

        def late_waits(phase: str) -> None:
            if rank == 1:
                time.sleep(late_s)
            for name, wait in (
                    ("cpu", lambda: dist.barrier(group=tp.cpu_group)),
                    ("device", lambda: dist.all_reduce(torch.ones(1), group=tp.device_group))):
                t0 = time.monotonic()
                try:
                    wait()
                    out[f"{phase}_{name}"] = "ok"
                except Exception as e:  # noqa: BLE001 - the test reads it
                    out[f"{phase}_{name}"] = f"{type(e).__name__}: {e}"[:300]
                    return  # the group is broken from here on
                finally:
                    out[f"{phase}_{name}_s"] = time.monotonic() - t0
                if rank == 1:
                    time.sleep(late_s)  # late again for the next wait

        late_waits("startup")
        if out.get("startup_cpu") != "ok" or out.get("startup_device") != "ok":
            return out
        dist.barrier(group=ps.get_world_group().cpu_group)  # both past the start-up waits
        out["restored"] = startup_timeouts.restore()
        late_waits("after")
    return out
