"""The ``small`` profile's worked programs, run as a small model that copies them runs them.

The embedded 0.5B copies a worked program almost token for token and changes little more than
the question's words, so the programs themselves must be right: each test takes a program out
of the rendered system prompt, makes the change a copying model makes, and runs it in a real
kernel against the scripted endpoint.
"""
from __future__ import annotations

import pytest

from conftest import Reply, last_user, repl, script, sub_requests

META = {"type": "str", "chars": 10, "tokens_estimate": 3}
FILLER = "The river ran past the mill and the fields were quiet. " * 300


def _program(after: str, depth: int = 1) -> str:
    """The code of the first ```repl block after ``after`` in the small profile's prompt."""
    from rlm.prompting import prompts
    text = prompts.system_prompt(META, can_recurse=depth > 0, profile="small")
    return text.split(after, 1)[1].split("```repl\n", 1)[1].split("\n```", 1)[0]


def test_the_small_profile_offers_the_lookup_then_counting_and_ends_with_the_metadata():
    from rlm.prompting import prompts
    text = prompts.system_prompt(META, can_recurse=True, profile="small")
    lookup, count = text.index("Example 1. Question"), text.index("Example 2. Question")
    assert lookup < count  # with counting first, the 0.5B wrote its own code for lookups
    assert "llm_query(" in text[lookup:count] and "re.findall" in text[count:]
    # the map over items is a rule, not a third program (as a program it was spliced in)
    assert "llm_query_batched` about groups of items" in text
    assert text.count("```repl\n") == 2
    # the metadata is the prompt's tail, so its fixed part is a reusable prefix
    assert text.rstrip().rsplit("\n", 1)[-1].startswith("About `context`:")


@pytest.mark.parametrize("sub_reply,answer", [
    ("7341-QX", "7341-QX"),                                # word for word
    ("The code is 7341-QX.", "The code is 7341-QX"),      # worded otherwise, every word there
    ("7341-QX, 7342-QY", "7341-QX, 7342-QY"),              # a list
    ("9999-ZZ", "NOT FOUND"),                              # invented: not in the window
    ("NONE", "NOT FOUND")])
def test_the_lookup_keeps_a_reply_only_when_its_window_has_every_word(api, sub_reply, answer):
    code = _program("Example 1. Question").replace(
        '"What colour is the door of the old lighthouse?"', '"What are the vault codes?"').replace(
        '["lighthouse", "door", "colour"]', '["vault", "codes"]')
    context = FILLER + "The code of the east vault is 7341-QX; the west vault's is 7342-QY. " + FILLER

    def sub(req):
        assert "What are the vault codes?" in last_user(req)
        return Reply(content=sub_reply)

    res, srv = api(script([repl(*code.splitlines())], sub), context, "What are the vault codes?",
                   prompt="small", max_depth=1)
    assert res.status == "completed", res.reason
    assert res.answer == answer
    assert len(sub_requests(srv)) == 1  # one place: both codes lie in one window


@pytest.mark.parametrize("target,ignore_case,expected", [
    ("vault", True, "7"), ("vault", False, "4"), ("open vault", True, "2"),
    ("open vault", False, "1")])
@pytest.mark.parametrize("depth", [0, 1])
def test_the_counting_program_counts_whole_words_exactly(api, target, ignore_case, expected,
                                                         depth):
    """Counted as the question states it: whole words ('vaults', 'vaulted' do not count), a
    phrase as a word, with or without case; the same program at depth 0, where it needs no
    sub-call."""
    code = _program("Example 2. Question", depth).replace('"harbour"', f'"{target}"')
    if not ignore_case:  # "exactly as written": the prompt says to leave out re.IGNORECASE
        code = code.replace(", re.IGNORECASE", "")
    context = ("A vault. The vault, the Vault! vaults and vaulted rooms; VAULT and vault. "
               "open vault, Open Vault, open vaulted. " + FILLER)
    res, srv = api(script([repl(*code.splitlines())]), context,
                   f'How many times does "{target}" appear?', prompt="small",
                   max_depth=depth)
    assert res.status == "completed", res.reason
    assert res.answer == expected
    assert sub_requests(srv) == []


def test_the_most_common_hint_runs_in_the_counting_program(api):
    """The hint's FINAL line in place of the counting program's, as the model writes it for
    "most common" questions, without the import the hint names: it runs (the program imports
    Counter; with the import only in the hint the 0.5B left it out and resent the NameError)."""
    from rlm.prompting import prompts
    text = prompts.system_prompt(META, can_recurse=True, profile="small")
    final = text.split('For "the 3 most common words": ', 1)[1].split("and `", 1)[1]
    final = final.split("`.", 1)[0]
    code = _program("Example 2. Question").replace("FINAL(count)", final)
    context = "Apple pear apple, plum. PEAR apple fig pear plum apple " + "kiwi " * 3
    res, _ = api(script([repl(*code.splitlines())]), context,
                 "What are the 3 most common words?", prompt="small")
    assert res.status == "completed", res.reason
    assert res.answer == "apple, pear, kiwi"
