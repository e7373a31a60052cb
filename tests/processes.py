"""What the tests read of processes, from /proc: whether one runs, and which run as another's children."""
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
