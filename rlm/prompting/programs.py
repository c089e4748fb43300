"""The worked programs the ``small`` profiles show: a lookup and a count, as a small model
copies them.

The embedded 0.5B copies a worked program almost token for token and changes little more than
the question and the search words, so each program must run on any context a user can give
(no match at all, a word found only inside a longer one cut at a window's edge, a list or a
dict, one huge line, an empty text, non-ASCII text, words with regex metacharacters) and must
read what it can from the question itself instead of from a flag the model would have to flip.
Both programs therefore start with ``question =`` and the question in triple double quotes:
the model writes the question there (a question with quotes or an apostrophe stays one string).

The lookup (Example 1):

1. find every match of the question's rare words (a word start with up to two more letters, so
   plurals match and "Dan" does not match "danger"); a word with no match counts for nothing;
2. score each match by the words that also occur in its 1,000-character block or the blocks
   beside it, each weighted by 1/its number of matches (a word's blocks are a set made once, so
   no weight is ever 1/0, no window is searched again, and the program imports nothing a
   model could swap for the counting program's import);
3. ask ``llm_query`` about a 3,000-character window around at most 4 distinct best places,
   for "the answer only, or NONE if the text does not say" (the measured wording); a question
   in two parts ("..., and why?") is asked without its second part here, because the 0.5B
   answered NONE to two-part questions whenever the prompt offered NONE, even with the fact in
   its window (2 of 2 questions, each with 7 wordings that offered NONE);
4. keep a reply only when it answers (:data:`KEEP_RULE`): not NONE, at most 30 words, every
   word found in its window (small sub-models invent plausible answers), and at least one word
   that is not in the question (a copied sentence made of the question's own words, or a reply
   that restates the question, is not an answer);
5. for a two-part question, ask the kept window again for both parts "in one sentence that
   starts with" the first reply, with no NONE offered (the window holds the first part's
   answer, so invention is less likely; asked only "Answer both parts of the question", the
   0.5B gave the first part alone, 1 of 2 times), and take that reply when it contains every
   word of the first (else the first stands);
6. call ``FINAL`` from code, "NOT FOUND" when no window gave a kept reply.

The count (Example 2) counts whole words or a phrase (any run of whitespace between the
phrase's words, so a phrase broken over lines counts), ignoring case unless the question asks
for case ("case-sensitive", "exact case", "match case", "exactly as written", "capital"...)
without saying the opposite ("case-insensitive", "ignoring case", "any case"...).
"""
from __future__ import annotations

#: What the lookup keeps, in words (docs and tests quote it).
KEEP_RULE = ("a reply is kept when it is not NONE, has at most 30 words, every one of its words "
             "occurs in its window, and at least one of them is not a word of the question")

#: The lookup's start: the question, the words, the text, every match and each place's score.
LOOKUP_FIND = r'''```repl
import re
question = """What colour is the door of the old lighthouse?"""
words = ["lighthouse", "door", "colour"]
{to_text}
def find(word, s):
    return [m.start() for m in re.finditer(r"(?<!\w)" + re.escape(word.strip()) + r"\w{{0,2}}(?!\w)", s, re.IGNORECASE)] if word.strip() else []
found = {{w: find(w, text) for w in words}}
print({{w: len(p) for w, p in found.items()}})
blocks = {{w: {{q // 1000 for q in p}} for w, p in found.items()}}
places = []
for w in words:
    for pos in found[w]:
        b = pos // 1000
        places.append((sum(1 / len(found[v]) for v in found if blocks[v] & {{b - 1, b, b + 1}}), pos))
places.sort(key=lambda p: -p[0])
'''

#: The lookup's end with sub-calls: ask about the best windows, keep a reply by
#: :data:`KEEP_RULE` (one rule a line: a model that copies a long condition drops a part of
#: it), FINAL it (or NOT FOUND).
LOOKUP_ASK = r"""one = re.split(r",? and (?=why|when|where|who|what|which|how)", question)[0].rstrip("?, ") + "?"
answer = None
asked = []
for score, pos in places:
    if len(asked) == 4:
        break
    if any(abs(pos - a) < 2000 for a in asked):
        continue
    asked.append(pos)
    window = text[max(0, pos - 1500):pos + 1500]
    reply = llm_query("Text: " + window + "\n\nQuestion: " + one + "\nAnswer with the answer only, or NONE if the text does not say.")
    reply = str(reply).strip().strip(".")
    print(pos, repr(reply))
    said = set(re.findall(r"\w+", reply.lower()))
    kept = reply and not reply.upper().startswith("NONE") and len(reply.split()) <= 30
    kept = kept and said <= set(re.findall(r"\w+", window.lower()))
    kept = kept and said - set(re.findall(r"\w+", question.lower()))
    if kept and one != question:
        both = str(llm_query("Text: " + window + "\n\nQuestion: " + question + "\nAnswer both parts of the question in one sentence that starts with \"" + reply + "\".")).strip()
        if said <= set(re.findall(r"\w+", both.lower())):
            reply = both
    if kept:
        answer = reply
        break
if answer is None:
    answer = "NOT FOUND"
FINAL(answer)
```
"""

#: The lookup's end without sub-calls (max_depth=0): print the best windows for the model.
LOOKUP_SHOW = r"""shown = []
for score, pos in places:
    if len(shown) == 3:
        break
    if any(abs(pos - a) < 1000 for a in shown):
        continue
    shown.append(pos)
    print(pos, repr(text[max(0, pos - 300):pos + 300]))
```
Read the windows it prints. In your next turn, call FINAL with the answer they give (in a ```repl block), or FINAL("NOT FOUND") when none of them has it.
"""

#: The lookup program (Example 1) with sub-calls, from ```repl to the closing ```.
LOOKUP = LOOKUP_FIND + LOOKUP_ASK
#: The lookup program for a loop without sub-calls.
LOOKUP_NO_SUBCALLS = LOOKUP_FIND + LOOKUP_SHOW

#: The case rule as the counting program reads it from the question: ``exact`` is true when
#: the question asks for case and does not also say to ignore it (two short statements, not
#: one long condition: a copying model drops parts of long lines).
CASE_RULE = (r'exact = re.search(r"case.sensitive|exact case|exactly as written|match(es|ing)? '
             r'(the )?case|same case|capital|upper.?case|lower.?case", question, re.I)' "\n"
             r'if re.search(r"insensitive|not case|ignor\w* (the )?case|any (case|capital)|'
             r'regardless of (case|capital)", question, re.I):' "\n"
             "    exact = None")

#: The counting program (Example 2), the hint for most-common questions, and the context's
#: metadata last, so everything before it is a fixed prefix llama.cpp's prompt cache reuses.
#: The program imports ``Counter`` though the count does not use it: the 0.5B writes the hint's
#: FINAL line in place of the program's and leaves out the import the hint names (then resends
#: the NameError); and the hint keeps its wording: "the same program ends with `FINAL(...)`"
#: made the model FINAL the count instead (cwe and fwe at 36k).
COUNT_EXAMPLE = r'''
Example 2. Question: "How many times does the word "harbour" appear in the text? Count whole words, ignoring case."
```repl
import re
from collections import Counter
question = """How many times does the word "harbour" appear in the text? Count whole words, ignoring case."""
target = "harbour"
{to_text}
''' + CASE_RULE + r'''
pattern = r"(?<!\w)" + r"\s+".join(re.escape(part) for part in target.split()) + r"(?!\w)"
count = len(re.findall(pattern, text, 0 if exact else re.IGNORECASE))
print(count)
FINAL(count)
```
The program reads the case rule from `question` ("case-sensitive", "exact case" or "match case" count only that case), so copy the question there whole. For "the 3 most common words": `from collections import Counter` and `FINAL(", ".join(w for w, n in Counter(re.findall(r"[a-z]+", text.lower())).most_common(3)))`.

In your code, use the question you were asked and its own words, not the words of these examples.

About `context`: {meta}
'''
