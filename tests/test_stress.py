"""The stress tool finds abnormal exits and cuts out their faulthandler stacks (issue 7 section 7)."""

from __future__ import annotations

import sys

from ltp_tools import stress


def test_a_segfaulting_run_is_abnormal_with_its_stack(tmp_path):
    code = "import ctypes\ndef crash():\n    ctypes.string_at(0)\ncrash()\n"
    r = stress.run_one("probe", [sys.executable, "-c", code], 0, tmp_path / "x.log", 60, debug_alloc=False)
    assert r.abnormal and r.returncode == -11 and r.signal == "SIGSEGV" and not r.timed_out
    assert any(m.startswith("fatal_python_error") for m in r.markers)
    assert r.stacks and "Fatal Python error: Segmentation fault" in r.stacks[0]
    assert 'line 3 in crash' in "\n".join(r.stacks)


def test_a_hung_run_is_aborted_and_dumps_every_thread(tmp_path):
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)\n"
    r = stress.run_one("probe", [sys.executable, "-c", code], 1, tmp_path / "y.log", 1.0, debug_alloc=False)
    assert r.abnormal and r.timed_out and r.signal == "SIGABRT"
    text = "\n".join(r.stacks)
    assert "Fatal Python error: Aborted" in text and text.count("Thread 0x") + text.count("Current thread") >= 2


def test_a_clean_run_is_ok_and_a_failed_one_is_not(tmp_path):
    ok = stress.run_one("probe", [sys.executable, "-c", "print('fine')"], 2, tmp_path / "z.log", 60, False)
    assert not ok.abnormal and ok.returncode == 0 and ok.markers == [] and ok.stacks == []
    bad = stress.run_one("probe", [sys.executable, "-c", "raise SystemExit(3)"], 3, tmp_path / "w.log", 60, False)
    assert bad.abnormal and bad.returncode == 3 and bad.signal is None


def test_debug_allocator_is_passed_to_children(tmp_path):
    code = "import os, sys; print(os.environ['PYTHONMALLOC'], sys.flags.dev_mode)"
    r = stress.run_one("probe", [sys.executable, "-c", code], 4, tmp_path / "d.log", 60, debug_alloc=True)
    assert not r.abnormal and "debug True" in open(r.log).read()


def test_launcher_messages_and_tp_clear_are_markers():
    log = ("[launch] worker 2 (pid 9) was killed by SIGSEGV\n"
           "Exception ignored in tp_clear of <class 'memoryview'>:\n"
           "BufferError: memoryview has 1 exported buffer\n")
    names = [m.split(":")[0] for m in stress.find_markers(log)]
    assert names == ["tp_clear", "child_signal"]
    assert stress.extract_stacks(log)[0].startswith("Exception ignored in tp_clear")


def test_schedule_mixes_fairness_in():
    args = stress.build_parser().parse_args(["--runs", "10", "--fairness-every", "5"])
    assert stress.schedule(args) == ["main"] * 4 + ["fairness"] + ["main"] * 4 + ["fairness"]
    cmd = stress.job_command("main", args, 3, None)
    assert cmd[3:] == ["launch", "--transport", "ltp", "--workers", "4", "--model", "digits", "--epochs", "15",
                       "--seed", "3", "--loss", "0.01"]
