"""``standins.flags``: the stand-in SGLang server's command line, read without importing torch; how
``StandinPool`` splits a test's flags into those that shape the process and those
``/standin/configure`` sets on a running one."""

import pytest

from standins.flags import RUNTIME_DESTS, RUNTIME_FLAGS, parse_args, parser, split_flags


def test_each_runtime_flag_is_a_flag_of_the_server_and_names_its_parsed_value():
    args = parse_args(["--checkpoint", "c", "--port", "0"])
    assert set(RUNTIME_FLAGS) <= set(parser()._option_string_actions)
    assert all(hasattr(args, dest) for dest in RUNTIME_DESTS) and args.sglang_version == "0.5.15.post1"


def test_flags_split_in_order_with_as_many_values_as_the_parser_gives_each():
    start, runtime = split_flags(("--max-seq-len", "512", "--weight-update-session", "--slots", "8",
                                  "--step-delay-s=0.02", "--incremental-streaming-output", "--port", "0"))
    assert start == ("--max-seq-len", "512", "--slots", "8", "--port", "0")
    assert runtime == ("--weight-update-session", "--step-delay-s=0.02", "--incremental-streaming-output")


@pytest.mark.parametrize("args, word", [(("--step-delay", "1"), "--step-delay"),  # no abbreviation
                                       (("512",), "512"), (("--slots", "8", "--nope"), "--nope")])
def test_a_word_that_is_no_flag_of_the_server_is_refused_by_name(args, word):
    with pytest.raises(ValueError, match=f"'{word}' is no flag of the stand-in SGLang server"):
        split_flags(args)
