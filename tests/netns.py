"""A second "host" for multi-node tests: a network namespace on a veth pair."""

from __future__ import annotations

import os
import subprocess

__all__ = ["VethPair"]


class VethPair:
    """A second "host" for multi-node tests: a network namespace joined to this one by a
    veth pair, ``10.77.<n>.1`` here and ``10.77.<n>.2`` there. Needs root and iproute2."""

    def __init__(self) -> None:
        n = os.getpid() % 200 + 20
        self.ns = f"ka-test-{os.getpid()}"
        self.here_if, self.there_if = f"kav{os.getpid() % 100000}h", f"kav{os.getpid() % 100000}t"
        self.here_ip, self.there_ip = f"10.77.{n}.1", f"10.77.{n}.2"
        self.prefix = ["ip", "netns", "exec", self.ns]

    def up(self) -> None:
        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

        ip("netns", "add", self.ns)
        ip("link", "add", self.here_if, "type", "veth", "peer", "name", self.there_if)
        ip("link", "set", self.there_if, "netns", self.ns)
        ip("addr", "add", f"{self.here_ip}/24", "dev", self.here_if)
        ip("link", "set", self.here_if, "up")
        ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.there_ip}/24", "dev",
           self.there_if)
        ip("netns", "exec", self.ns, "ip", "link", "set", self.there_if, "up")
        ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")

    def down(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.here_if], capture_output=True)
