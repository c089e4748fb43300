"""The ``small`` profile's worked programs, run as a small model that copies them runs them.

The embedded 0.5B copies a worked program almost token for token and changes little more than
the question's words, so the programs themselves must be right: each test takes a program out
of the rendered system prompt, makes the change a copying model makes, and runs it in a real
kernel against the scripted endpoint.
"""
from __future__ import annotations

import re

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


def _copied(code: str, question: str, **swap: str) -> str:
    """``code`` with the question and the example's words swapped as a copying model does."""
    code = re.sub(r'question = """.*?"""', lambda _: f'question = """{question}"""', code)
    for old, new in swap.items():
        code = code.replace(old, new)
    return code


VAULT = FILLER + "The code of the east vault is 7341-QX; the west vault's is 7342-QY. " + FILLER


@pytest.mark.parametrize("sub_reply,answer", [
    ("7341-QX", "7341-QX"),                                # word for word
    ("The code is 7341-QX.", "The code is 7341-QX"),      # worded otherwise, every word there
    ("7341-QX, 7342-QY", "7341-QX, 7342-QY"),              # a list
    ("9999-ZZ", "NOT FOUND"),                              # invented: not in the window
    ("NONE", "NOT FOUND"),
    ("None of it.", "NOT FOUND"),
    # a sentence of the question's own words, copied from the window: not an answer
    ("the vault", "NOT FOUND"),
    ("Vault.", "NOT FOUND"),
    # a copied passage (over 30 words), every word of it in the window
    ("The river ran past the mill and the fields were quiet " * 3 + "vault", "NOT FOUND")])
def test_the_lookup_keeps_a_reply_only_when_it_answers(api, sub_reply, answer):
    """The kept-reply rule (``programs.KEEP_RULE``): not NONE, at most 30 words, every word in
    its window, and a word that is not the question's."""
    code = _copied(_program("Example 1. Question"), "What are the vault codes?",
                   **{'["lighthouse", "door", "colour"]': '["vault", "codes"]'})

    def sub(req):
        assert "What are the vault codes?" in last_user(req)
        return Reply(content=sub_reply)

    res, srv = api(script([repl(*code.splitlines())], sub), VAULT, "What are the vault codes?",
                   prompt="small", max_depth=1)
    assert res.status == "completed", res.reason
    assert res.answer == answer
    # one place (both codes lie in one window); a reply not kept leaves nothing else to ask
    assert len(sub_requests(srv)) == 1


@pytest.mark.parametrize("both,answer", [
    ("Acme Corp, after repeated late deliveries of steel.",
     "Acme Corp, after repeated late deliveries of steel."),
    # a second reply that drops the first part's answer: the first stands
    ("Because of late deliveries.", "Acme Corp")])
def test_a_two_part_question_is_found_by_its_first_part_then_asked_whole(api, both, answer):
    """"Which supplier was dropped in 2019, and why?": the 0.5B answered NONE to two-part
    questions whenever NONE was offered, even with the fact in its window. The lookup finds
    the window with the first part ("Which supplier was dropped in 2019?", NONE offered), then
    asks that window for both parts; that reply replaces the first when it contains it."""
    question = "Which supplier was dropped in 2019, and why?"
    code = _copied(_program("Example 1. Question"), question,
                   **{'["lighthouse", "door", "colour"]': '["supplier", "dropped", "2019"]'})
    context = (FILLER + "In 2019 the company dropped its supplier Acme Corp after repeated late "
               "deliveries of steel. " + FILLER)
    asked = []

    def sub(req):
        asked.append(last_user(req).rsplit("Question: ", 1)[1])
        return Reply(content="Acme Corp" if "NONE" in asked[-1] else both)

    res, _ = api(script([repl(*code.splitlines())], sub), context, question, prompt="small",
                 max_depth=1)
    assert res.status == "completed", res.reason
    assert asked == ["Which supplier was dropped in 2019?\nAnswer with the answer only, or NONE "
                     "if the text does not say.",
                     question + "\nAnswer both parts of the question in one sentence that "
                     'starts with "Acme Corp".']
    assert res.answer == answer


def test_a_one_part_question_is_asked_once_with_none_offered(api):
    code = _copied(_program("Example 1. Question"), "What are the vault codes?",
                   **{'["lighthouse", "door", "colour"]': '["vault", "codes"]'})
    asked = []

    def sub(req):
        asked.append(last_user(req).rsplit("Question: ", 1)[1])
        return Reply(content="7341-QX")

    res, _ = api(script([repl(*code.splitlines())], sub), VAULT, "What are the vault codes?",
                 prompt="small", max_depth=1)
    assert res.answer == "7341-QX"
    assert asked == ["What are the vault codes?\nAnswer with the answer only, or NONE if the "
                     "text does not say."]


CASE_TEXT = ("A vault. The vault, the Vault! vaults and vaulted rooms; VAULT and vault. "
             "open vault, Open Vault, open\nvault, open vaulted. " + FILLER)


@pytest.mark.parametrize("question,target,expected", [
    ('How many times does "vault" appear?', "vault", "8"),
    ('How many times does the word "vault" appear? Count whole words, ignoring case.', "vault",
     "8"),
    ('How many times does "vault" appear, case-sensitive?', "vault", "5"),
    ('Count the exact case matches of "Vault".', "Vault", "2"),
    ('How often is "VAULT" written, match case?', "VAULT", "1"),
    ("How many times does 'Vault' appear with a capital V?", "Vault", "2"),
    ('How many times does "vault" occur, exactly as written?', "vault", "5"),
    ('How many times does "Vault" appear? Case-insensitive.', "Vault", "8"),
    ('How many times does "Vault" appear regardless of case?', "Vault", "8"),
    ('How many times does the phrase "open vault" appear?', "open vault", "3"),
    ('How many times does the phrase "open vault" appear (case-sensitive)?', "open vault", "2")])
@pytest.mark.parametrize("depth", [0, 1])
def test_the_counting_program_follows_the_case_and_phrase_rules_the_question_states(
        api, question, target, expected, depth):
    """The model copies the question and the word; the program reads the case rule from the
    question's own words (a flag the model had to flip, it never flipped), counts whole words
    ('vaults', 'vaulted' do not count) and a phrase across a line break; the same program at
    depth 0, where it needs no sub-call."""
    code = _copied(_program("Example 2. Question", depth), question,
                   **{'"harbour"': repr(target)})
    res, srv = api(script([repl(*code.splitlines())]), CASE_TEXT, question, prompt="small",
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


def test_the_lookup_runs_with_the_counting_programs_head_in_place_of_its_own(api):
    """Seen on the embedded model: the lookup copied with Example 2's imports in place of its
    own head. The lookup needs no import but ``re``, so the blend still runs and answers."""
    lookup = _copied(_program("Example 1. Question"), "What are the vault codes?",
                     **{'["lighthouse", "door", "colour"]': '["vault", "codes"]'})
    count_head = _program("Example 2. Question").split("question = ", 1)[0]
    lookup_head = lookup.split("question = ", 1)[0]
    code = count_head + lookup[len(lookup_head):]
    res, _ = api(script([repl(*code.splitlines())], lambda req: Reply(content="7341-QX")),
                 VAULT, "What are the vault codes?", prompt="small", max_depth=1)
    assert res.status == "completed", res.reason
    assert res.answer == "7341-QX"
