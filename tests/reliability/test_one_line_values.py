"""Errors that were not one line: a user's value holding a newline echoed on two lines (the root printer,
kveval.messages.print_error, escapes control characters as Python writes them), lm-eval's argparse usage text plus
its error for a bad ``kveval lm-eval -- ...`` argument (one line with argparse's message), and lm-eval's backend
named through another spelling of ``--model`` (``-Mhf``, ``-M=hf``...), which slipped past the refusal."""

from __future__ import annotations

import pytest


def test_a_newline_in_a_value_is_shown_escaped(h):
    line = h.assert_user_error(h.invoke("ls", "--grep", "a\nb"), "nothing holds 'a\\nb'")
    assert line == "error: kveval ls: nothing holds 'a\\nb'"


def test_a_carriage_return_and_an_escape_sequence_are_shown_escaped(h):
    h.assert_user_error(h.invoke("ls", "--grep", "a\rb\x1b[2Jc"), "'a\\rb\\x1b[2Jc'")


def test_lm_eval_argparse_error_is_one_line(h):
    result = h.invoke("lm-eval", "--kv", "int8", "--", "--gen_kwargs", "notkeyvalue", "--tasks", "x")
    h.assert_user_error(result, "lm-eval refused its arguments", "--gen_kwargs", "notkeyvalue")
    assert "usage:" not in result.output, result.output


def test_lm_eval_unknown_option_is_one_line(h):
    h.assert_user_error(h.invoke("lm-eval", "--kv", "int8", "--", "--no-such-option", "--tasks", "x"),
                        "unrecognized arguments: --no-such-option")


@pytest.mark.parametrize("spelling", [["-Mhf"], ["-M=hf"], ["-M", "hf"], ["--model=hf"], ["--model", "hf"]],
                         ids=["-Mhf", "-M=hf", "-M hf", "--model=hf", "--model hf"])
def test_every_spelling_of_lm_evals_model_is_refused(h, spelling):
    h.assert_user_error(h.invoke("lm-eval", "--kv", "int8", "--", *spelling, "--tasks", "x"),
                        "lm-eval's --model names the backend", "not 'hf'", "--pretrained")


def test_an_abbreviation_of_model_is_one_line(h):
    h.assert_user_error(h.invoke("lm-eval", "--kv", "int8", "--", "--mode", "hf", "--tasks", "x"),
                        "ambiguous option: --mode")


def test_lm_evals_help_still_prints(h):
    result = h.invoke("lm-eval", "--", "-h")
    assert result.exit_code == 0, result.output
    assert "--gen_kwargs" in result.stdout
