"""The files the embedded question set asks about: prose, code, a log, a CSV, a folder of notes.

:func:`write_data` writes them under one directory, the same bytes for the same seed, and
returns the facts it planted; the questions (:mod:`evals.questions_embedded`) take their answers
from those facts and from :func:`count_words`, which counts in the written files by code, so no
answer is typed by hand.

Layout (``ROOT/``)::

    report.txt          prose, about 60,000 characters, with planted facts and counted words
    code/app/*.py       a small Python package (config values, imports, functions, TODOs)
    code/tests/*.py
    logs/app.log        3,000 log lines with levels, planted incidents and counted words
    sales.csv           2,000 rows: date, region, sku, qty, price
    notes/*.md          8 short notes (deprecations, a backup schedule, on-call numbers)
"""
from __future__ import annotations

import random
import re
from pathlib import Path

FILLER_WORDS = ("the quarterly review covered budgets staffing travel training offices vendors "
                "invoices contracts forecasts meetings suppliers deliveries policy audit board "
                "team schedule report market customers pricing margin growth risk plan").split()


def count_words(text: str, target: str, exact_case: bool) -> int:
    """How many times ``target`` (a word or a phrase) occurs in ``text`` as whole words, any
    whitespace between a phrase's words; case-sensitive when ``exact_case``."""
    pattern = r"(?<!\w)" + r"\s+".join(re.escape(p) for p in target.split()) + r"(?!\w)"
    return len(re.findall(pattern, text, 0 if exact_case else re.IGNORECASE))


def _sentences(rng: random.Random, n: int, extra: list[str]) -> list[str]:
    """``n`` filler sentences, each with one of ``extra`` mixed in now and then."""
    out = []
    for _ in range(n):
        words = [rng.choice(FILLER_WORDS) for _ in range(rng.randint(8, 16))]
        if extra and rng.random() < 0.25:
            words.insert(rng.randint(0, len(words)), rng.choice(extra))
        line = " ".join(words)
        out.append(line[0].upper() + line[1:] + ".")  # str.capitalize would lower the rest
    return out


REPORT_FACTS = [
    "In 2019 the company dropped its supplier Halvorsen Metals because of repeated late "
    "deliveries.",
    "The warehouse in Tromsø opened in March 2016.",
    "The project code for the bridge renovation is KX-4471.",
    "Maria Okafor leads the audit team; she joined the company in 2012.",
    "The annual shareholder meeting is held in Bergen every June.",
]


def write_report(root: Path, rng: random.Random) -> None:
    """report.txt: filler with the words the counts ask about, and :data:`REPORT_FACTS`."""
    extra = ["Program", "program", "PROGRAM", "programs", "supply chain", "Supply Chain",
             "supply-chain", "late deliveries"]
    body = _sentences(rng, 800, extra)
    for i, fact in enumerate(REPORT_FACTS):
        body.insert(rng.randint(1, len(body) - 1), fact)
    paras = [" ".join(body[i:i + 6]) for i in range(0, len(body), 6)]
    (root / "report.txt").write_text("\n\n".join(paras) + "\n", encoding="utf-8")


CODE = {
    "code/app/__init__.py": '"""The app package."""\n',
    "code/app/config.py": ('"""Settings."""\n# TODO: read these from the environment\n'
                           "TIMEOUT = 37  # seconds before a request is abandoned\n"
                           "RETRIES = 5  # attempts per request\nREGION = 'eu-north-1'\n"),
    "code/app/net.py": ('"""HTTP calls."""\nimport requests\n\nfrom app.config import TIMEOUT\n\n\n'
                        "def fetch(url):\n    # todo: add caching\n"
                        "    return requests.get(url, timeout=TIMEOUT).text\n"),
    "code/app/db.py": ('"""Storage."""\nimport sqlite3\n\n\ndef connect(path):\n'
                       "    return sqlite3.connect(path)\n\n\ndef close(con):\n"
                       "    # TODO: flush first\n    con.close()\n"),
    "code/app/cli.py": ('"""Command line."""\nimport argparse\n\nimport requests\n\n\n'
                        "def main():\n    p = argparse.ArgumentParser()\n    p.parse_args()\n"
                        "    print(requests.__version__)\n"),
    "code/app/util.py": ('"""Helpers."""\n\n\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n'
                         "\n\ndef chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n"
                         "\n\ndef first(xs):\n    return xs[0] if xs else None\n\n\n"
                         "def define_later():\n    # TODO: remove; Todo list lives in notes\n"
                         "    pass\n"),
    "code/tests/test_util.py": ("from app.util import clamp\n\n\ndef test_clamp():\n"
                                "    assert clamp(5, 0, 3) == 3\n"),
}


def write_log(root: Path, rng: random.Random) -> dict:
    """logs/app.log: 3,000 lines; the planted incidents' lines are returned by name."""
    services = ["api", "worker", "scheduler", "billing"]
    msgs = ["request served", "cache miss", "job done", "retrying after timeout",
            "connection reset by peer", "slow query", "user error: bad input"]
    lines = []
    for i in range(3000):
        h, m, s = 8 + i // 240, (i // 4) % 60, (i * 7) % 60
        level = rng.choices(["INFO", "WARN", "ERROR"], [80, 15, 5])[0]
        lines.append(f"2024-03-05 {h:02d}:{m:02d}:{s:02d} {level} {rng.choice(services)}: "
                     f"{rng.choice(msgs)}")
    planted = {"disk": "2024-03-05 14:22:07 ERROR storage: disk full on /var/data",
               "locked": "2024-03-05 11:41:53 WARN auth: user jdoe locked out after 5 failed "
                         "logins",
               "restart": "2024-03-05 03:00:00 INFO scheduler: nightly restart of the billing "
                          "service"}
    for line in planted.values():
        lines.insert(rng.randint(10, len(lines) - 10), line)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    (root / "logs" / "app.log").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return planted


def write_csv(root: Path, rng: random.Random) -> dict:
    """sales.csv: 2,000 rows; one row for SKU-7731, whose fields are returned."""
    rows = ["date,region,sku,qty,price"]
    regions = ["North", "South", "East", "West"]
    for i in range(2000):
        rows.append(f"2024-{1 + i % 12:02d}-{1 + i % 28:02d},{rng.choice(regions)},"
                    f"SKU-{rng.randint(1000, 6999)},{rng.randint(1, 40)},"
                    f"{rng.randint(100, 9999) / 100:.2f}")
    special = {"region": "East", "qty": "17", "price": "412.50"}
    rows.insert(rng.randint(2, len(rows) - 1),
                f"2024-06-14,{special['region']},SKU-7731,{special['qty']},{special['price']}")
    (root / "sales.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return special


NOTES = {
    "notes/api-v1.md": "# API v1\nThe v1 endpoints are deprecated; use v2 by the end of the year.\n",
    "notes/backups.md": "# Backups\nBackups run every night at 02:30 and are kept for 35 days.\n",
    "notes/oncall.md": "# On call\nThe on-call phone number is +47 555 01 234; call it for "
                       "outages only.\n",
    "notes/kubernetes.md": "# Kubernetes\nOur Kubernetes clusters run version 1.29. Kubernetes "
                           "upgrades happen in spring. The old kubernetes-v1 charts are "
                           "deprecated.\n",
    "notes/onboarding.md": "# Onboarding\nNew staff get a laptop on their first day.\n",
    "notes/office.md": "# Office\nThe office closes at 18:00. Kubernetes training is in room "
                       "4.\n",
    "notes/travel.md": "# Travel\nBook trains, not flights, for trips under 500 km.\n",
    "notes/vendors.md": "# Vendors\nThe preferred laptop vendor is Nordlys Data.\n",
}


def write_data(root: Path, seed: int = 0) -> dict:
    """Write every file under ``root`` (created if needed) and return the planted facts:
    ``{"log": {name: line}, "sale": {region, qty, price}}``. Same seed, same bytes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    write_report(root, rng)
    for rel, text in {**CODE, **NOTES}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return {"log": write_log(root, rng), "sale": write_csv(root, rng)}


def read_tree(root: Path, under: str) -> dict[str, str]:
    """The text files under ``root/under`` as relative path -> text, sorted."""
    base = Path(root) / under
    return {p.relative_to(base).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(base.rglob("*")) if p.is_file()}
