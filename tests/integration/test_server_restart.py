"""``qfilters-mlx server --prompt-cache-dir`` (SmolLM2, subprocesses on 127.0.0.1) across a
restart: after a crash (SIGKILL) the follow-up turn reuses the whole stored conversation
(``cached_tokens``) and answers as the server that never restarted; a damaged file gives a 200
with the cold answer and a log line naming the file; the files are private; a second server on
the folder is refused at start.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys

import pytest

from helpers.server_corpus import CHAT, ServerProcess, answer, post_json

pytestmark = pytest.mark.integration

BUDGET = 64
PASSAGE = " ".join(f"Entry {i}: the river rose {i % 7} feet and the otters moved {i % 5} times."
                   for i in range(1, 25))
FIRST = [{"role": "system", "content": "You are a careful assistant who answers briefly."},
         {"role": "user", "content": PASSAGE + " In which entry did the river rise most?"}]


def _start(model_path, log, folder=None):
    argv = [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model_path),
            "--budget", str(BUDGET)]
    if folder is not None:
        argv += ["--prompt-cache-dir", str(folder)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return ServerProcess(argv, log, env=env, start_timeout=600)


def _ask(proc, messages):
    status, reply = post_json(proc.port, CHAT, {"messages": messages, "max_tokens": 8, "temperature": 0})
    assert status == 200, reply
    return answer(reply), reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["usage"]["prompt_tokens"]


def _follow(said, question):
    return FIRST + [{"role": "assistant", "content": said}, {"role": "user", "content": question}]


def test_a_conversation_survives_a_crash_and_a_damaged_file_is_computed_again(model_path, tmp_path):
    never = _start(model_path, tmp_path / "never.log")
    try:
        said, _, prompt_tokens = _ask(never, FIRST)
        want = _ask(never, _follow(said, "And the lowest?"))
    finally:
        never.stop()
    assert want[1] > prompt_tokens  # (the stored answer is reused, not only the prompt)

    folder = tmp_path / "conversations"
    crashed = _start(model_path, tmp_path / "crashed.log", folder)
    try:
        assert _ask(crashed, FIRST)[0] == said
        with pytest.raises(RuntimeError, match="another server uses this folder"):
            _start(model_path, tmp_path / "second.log", folder)
    finally:
        crashed.proc.kill()  # (a crash: no shutdown of any kind)
        crashed.stop()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.glob("*.safetensors"))
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    os.chmod(damaged, 0o700)

    restarted = _start(model_path, tmp_path / "restarted.log", folder)
    try:
        assert _ask(restarted, _follow(said, "And the lowest?")) == want
    finally:
        restarted.stop()

    names = sorted(damaged.glob("*.safetensors"))
    for p in names:  # (one byte of the arrays flipped)
        data = bytearray(p.read_bytes())
        data[-100] ^= 0x5A
        p.write_bytes(bytes(data))
    again = _start(model_path, tmp_path / "again.log", damaged)
    try:
        got = _ask(again, _follow(said, "And the highest?"))
    finally:
        again.stop()
    cold = _start(model_path, tmp_path / "cold.log")
    try:
        assert got == _ask(cold, _follow(said, "And the highest?"))
    finally:
        cold.stop()
    assert got[1] == 0
    log = (tmp_path / "again.log").read_text()
    assert "checksum mismatch" in log and all(str(p) in log and not p.exists() for p in names)
