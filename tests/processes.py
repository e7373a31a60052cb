"""What the tests read of processes, from /proc: whether one runs, and which run as another's children; and how a
test kills a server with the model processes it started."""
import os
import signal
import subprocess
from pathlib import Path


def alive(pid: int) -> bool:
    """Running: it exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def live_children(pid: int) -> set[int]:
    """The running child processes of `pid` (its threads' children too)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(p) for p in (task / "children").read_text().split())
    return {p for p in found if alive(p)}


def kill_with_children(process: subprocess.Popen) -> None:
    """SIGKILL a server and the children it runs (a tritonserver's backend stubs). A stub whose server dies by
    SIGKILL lives on, orphaned, holding its model's memory; it is found before the server dies, while it is still
    the server's child."""
    children = live_children(process.pid) if process.poll() is None else set()
    process.kill()
    process.wait()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
