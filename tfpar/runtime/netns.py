"""A private network for the workers of one local launch (Linux network namespaces).

TensorFlow 2.15's gRPC server listens on every interface (``*:port``, whatever
host ``TF_CONFIG`` names) and accepts any graph from anyone who connects: no
authentication, no encryption. A network namespace of its own, whose only
interface is loopback, makes the workers' ports reachable from their own
processes alone. Making one needs Linux and either root or unprivileged user
namespaces (a user namespace mapping this user to itself); containers often
forbid both (seccomp, no CAP_SYS_ADMIN), and Ubuntu 24.04 restricts the second
(AppArmor), which ``enter_private_network`` then reports.
"""
import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import sys
from typing import Optional

__all__ = ["contained", "enter_private_network"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def contained() -> bool:
    """Whether this process's network has no interface but loopback (a
    private namespace, or a container without a network)."""
    return all(name == "lo" for _, name in socket.if_nameindex())


def enter_private_network() -> Optional[str]:
    """Move this process, and every process it starts from now on, into a
    network namespace of its own with loopback up. Returns None, or why it
    could not (the process is then where it was: a forked child tries first,
    since a namespace entered whose loopback stays down cannot be left)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's, and this is {sys.platform}"
    readable, writable = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(readable)
        os.write(writable, (_enter() or "").encode())
        os._exit(0)  # pylint: disable=protected-access
    os.close(writable)
    with os.fdopen(readable, "rb") as answer:
        why = answer.read().decode() or None
    os.waitpid(child, 0)
    return why if why is not None else _enter()


def _enter() -> Optional[str]:
    """``enter_private_network`` in this very process."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    tried = []
    for flags, name in ((_CLONE_NEWNET, "unshare(CLONE_NEWNET)"),
                        (_CLONE_NEWUSER | _CLONE_NEWNET, "unshare(CLONE_NEWUSER|CLONE_NEWNET)")):
        if flags == _CLONE_NEWNET and uid != 0:
            continue  # needs CAP_SYS_ADMIN
        if libc.unshare(flags) == 0:
            try:
                if flags & _CLONE_NEWUSER:
                    _map_to_self(uid, gid)
                _loopback_up()
            except OSError as exc:
                return (f"{name} succeeded but loopback could not be brought up ({exc.strerror}): "
                        "the kernel gives a new user namespace no capabilities here (Ubuntu's "
                        "kernel.apparmor_restrict_unprivileged_userns)")
            return None
        tried.append(f"{name}: {os.strerror(ctypes.get_errno())}")
    return ("; ".join(tried) + " (run as root, or allow unprivileged user namespaces: "
            "sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; "
            "containers need --cap-add SYS_ADMIN or a seccomp profile allowing unshare)")


def _map_to_self(uid: int, gid: int) -> None:
    """In a new user namespace: this user and group are themselves there."""
    for path, text in (("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/setgroups", "deny"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w", encoding="ascii") as f:
            f.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
