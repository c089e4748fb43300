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
2. score each match by the words that also occur within 1,000 characters of it, each weighted
   by 1/its number of matches (found by bisecting the sorted positions, so no weight is ever
   1/0 and no window is searched again);
3. ask ``llm_query`` about a 3,000-character window around at most 4 distinct best places,
   for every part of the question in a few words from the text, or NONE;
4. keep a reply only when it answers (:data:`KEEP_RULE`): not NONE, at most 30 words, every
   word found in its window (small sub-models invent plausible answers), and at least one word
   that is not in the question (a copied sentence made of the question's own words, or a reply
   that restates the question, is not an answer);
5. call ``FINAL`` from code, "NOT FOUND" when no window gave a kept reply.

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
from bisect import bisect_left
question = """What colour is the door of the old lighthouse?"""
words = ["lighthouse", "door", "colour"]
{to_text}
found = {{w: [m.start() for m in re.finditer(r"(?<!\w)" + re.escape(w.strip()) + r"\w{{0,2}}(?!\w)", text, re.IGNORECASE)] for w in words if w.strip()}}
print({{w: len(p) for w, p in found.items()}})
def near(p, pos):
    i = bisect_left(p, pos - 1000)
    return i < len(p) and p[i] <= pos + 1000
places = []
for w, p in found.items():
    for pos in p:
        places.append((sum(1 / len(q) for q in found.values() if near(q, pos)), pos))
places.sort(key=lambda p: -p[0])
'''

#: The lookup's end with sub-calls: ask about the best windows, keep a reply by
#: :data:`KEEP_RULE`, FINAL it (or NOT FOUND).
LOOKUP_ASK = r"""asked_words = set(re.findall(r"\w+", question.lower()))
answer = None
asked = []
for score, pos in places:
    if len(asked) == 4:
        break
    if any(abs(pos - a) < 2000 for a in asked):
        continue
    asked.append(pos)
    window = text[max(0, pos - 1500):pos + 1500]
    reply = llm_query("Text: " + window + "\n\nQuestion: " + question + "\nAnswer every part of the question in a few words from the text, or NONE if the text does not say.")
    reply = str(reply).strip().strip(".")
    said = re.findall(r"\w+", reply.lower())
    print(pos, repr(reply))
    if said and said[0] != "none" and len(said) <= 30 and set(said) <= set(re.findall(r"\w+", window.lower())) and set(said) - asked_words:
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
#: the question asks for case and does not also say to ignore it.
CASE_RULE = (r'exact = bool(re.search(r"case.sensitive|exact case|exactly as written|match(es|ing)? '
             r'(the )?case|same case|capital|upper.?case|lower.?case", question, re.I)) and not '
             r're.search(r"insensitive|not case|ignor\w* (the )?case|any (case|capital)|regardless of (case|capital)", '
             r'question, re.I)')

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
