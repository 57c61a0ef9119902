"""``generate --context-file/--question/--compression-ratio``: flag errors (before any model
loads) and the context/question split of the chat prompt."""

import pytest

from qfilters_mlx.commands.cli import main
from qfilters_mlx.commands.questions import split_prompt


@pytest.mark.parametrize("argv, needle", [
    (["--question", "Q"], "--question needs --context-file"),
    (["--context-file", "x.txt"], "at least one --question"),
    (["--compression-ratio", "1.0"], "--compression-ratio must be in [0, 1)"),
    (["--compression-ratio", "0.5", "--growth", "-1"], "--growth must be >= 0"),
    (["--growth", "3"], "--growth needs --compression-ratio"),
    (["--compression-ratio", "0.5", "--compare"], "cannot be used with --compare"),
    (["--context-file", "x.txt", "--question", "Q", "--prompt", "hi"], "--prompt cannot be used"),
])
def test_flag_errors(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("some context")
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


class _Tok:
    """A character tokenizer with a ChatML-like template (stands in for mlx-lm's wrapper)."""

    has_chat_template = True

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in ("^" if add_special_tokens else "") + text]


def test_split_prompt_is_the_joint_prompt_cut_before_the_question():
    tok = _Tok()
    ctx, qs = split_prompt(tok, "the context", ["q one?", "q2"], system_prompt="sys")
    for q, tokens in zip(["q one?", "q2"], qs):
        joint = tok.apply_chat_template([{"role": "system", "content": "sys"},
                                         {"role": "user", "content": "the context\n\n" + q}],
                                        tokenize=False, add_generation_prompt=True)
        assert ctx + tokens == tok.encode(joint, add_special_tokens=False)
