"""The stub watchdog's reloads files (diffulex_backend/serving/stub_watchdog.py) go with the server that they count
for: every watchdog removes, as it starts, the files of servers that are gone, and the files of live servers stay.
The whole watchdog, over a real tritonserver that dies, is tests/server/test_stub_death.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from diffulex_backend.serving.stub_watchdog import forget_gone_servers, reloads_file


def a_gone_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_reloads_files_of_gone_servers_are_removed_and_those_of_live_ones_kept(tmp_path):
    gone, live = a_gone_pid(), os.getpid()
    files = {(pid, model): reloads_file(pid, model, tmp_path)
             for pid in (gone, live) for model in ("diffulex", "diffulex-two")}
    for path in files.values():
        path.write_text(json.dumps([1.0]))
    unrelated = tmp_path / "diffulex-watchdog-notes.txt"  # not a reloads file: never touched
    unrelated.write_text("x")
    forget_gone_servers(tmp_path)
    assert {key for key, path in files.items() if path.exists()} == {(live, "diffulex"), (live, "diffulex-two")}
    assert unrelated.exists()


def test_a_watchdog_that_saw_its_server_end_removes_that_server_s_files_only(tmp_path):
    gone, other_gone = a_gone_pid(), a_gone_pid()
    mine, others = reloads_file(gone, "diffulex", tmp_path), reloads_file(other_gone, "diffulex", tmp_path)
    for path in (mine, others):
        path.write_text("[]")
    forget_gone_servers(tmp_path, server_pid=gone)
    assert not mine.exists() and others.exists()
