"""What steers a chat model when it writes its own user turns (Magpie-style self-prompting).

The model sees its chat template up to an opened user turn and writes the user's message
itself, until its end-of-turn token. Alone, a small model writes the same few messages again
and again; a system prompt that says who the user is and what they want spreads the messages
over many tasks and topics. Everything here is drawn from a ``random.Random`` seeded by the
sample's index (:func:`plan`), so a sample is the same whenever and wherever it is made.

Topics come from text already on the machine: a list of everyday subjects written here, the
titles of Python's reference topics (``pydoc_data.topics``) and the first lines of the
standard library's module docstrings (the zoo's training files only; the held-out files are
the benchmark's). The system prompt the answer is written under is a separate draw: most
answers get the template's own default (as the benchmark's prompts do), some a persona.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

UNSTEERED_SHARE = 0.15  # user turns written under the template's default system prompt alone (pure Magpie)
PERSONA_SHARE = 0.3  # answers written under a persona's system prompt rather than the template's default

SUBJECTS = (
    "cooking and recipes", "personal finance and budgeting", "world history", "ancient Rome", "physics",
    "chemistry", "biology", "astronomy", "geography", "travel planning", "learning a foreign language",
    "job interviews", "writing a cover letter", "fitness and exercise", "healthy eating", "sleep", "gardening",
    "pets", "music theory", "learning the guitar", "movies", "novels and reading", "poetry", "philosophy",
    "economics", "climate and weather", "renewable energy", "cars and driving", "home repair", "parenting",
    "friendship and relationships", "time management", "studying for exams", "statistics", "algebra",
    "geometry", "probability", "spreadsheets", "databases and SQL", "web development", "JavaScript",
    "the Linux command line", "git", "machine learning", "computer networks", "cybersecurity", "smartphones",
    "small business", "marketing", "public speaking", "psychology", "art history", "photography", "sports",
    "chess", "board games", "video games", "mythology", "law and contracts", "medicine and first aid",
    "the ocean", "volcanoes and earthquakes", "birds", "space exploration", "architecture", "fashion",
    "wine and coffee", "baking bread", "event planning", "writing fiction", "email etiquette", "news and media",
)

TASKS = (
    "asks a question about", "asks for an explanation, in simple words, of something in", "asks for advice about",
    "asks for a short story involving", "asks for a poem about", "asks for a list of ideas about",
    "asks you to compare two things in", "asks for step-by-step instructions for a task in",
    "asks for help writing an email about", "asks you to summarise a paragraph they paste about",
    "asks you to translate a few sentences about", "asks you to correct the grammar of a paragraph they wrote about",
    "asks you to solve a word problem about", "asks for a Python function related to",
    "asks you to explain a piece of code about", "asks for the pros and cons of something in",
    "asks a trivia question about", "asks you to rewrite a short text about", "asks for a plan or schedule for",
    "asks for a definition of a term from", "asks you to fix a bug in a short program about",
    "asks for a recommendation about",
)

USERS = ("The user", "A student", "A beginner", "A curious user", "A busy professional", "A teacher",
         "A developer", "A writer", "A retired engineer", "A high-school student")

PERSONAS = (
    "You are a helpful assistant.", "You are a concise assistant: answer in a few sentences.",
    "You are a patient teacher who explains step by step.", "You are a friendly and encouraging assistant.",
    "You are an expert programmer. Answer with code where it helps.", "You are a careful assistant who "
    "checks facts and says when it is unsure.", "You are a creative writing assistant.",
)


@lru_cache(maxsize=1)
def pydoc_titles() -> tuple[str, ...]:
    """Python's reference topics by the first line of their text ("The "for" statement")."""
    from pydoc_data.topics import topics

    titles = []
    for _, text in sorted(topics.items()):
        line = next((line.strip() for line in text.splitlines() if line.strip()), "")
        if 3 <= len(line) <= 80:
            titles.append(f"Python ({line})")
    return tuple(titles)


_DOCSTRING = re.compile(r'^\s*(?:#[^\n]*\n\s*)*[rRuU]?("""|\'\'\')\s*(.+?)\s*$', re.M)


@lru_cache(maxsize=1)
def docstring_topics() -> tuple[str, ...]:
    """The first line of each training file's module docstring ("Functions to convert between
    Python values and C structs."), read from the files' first 2 KB."""
    from ..zoo.corpus import training_files

    topics = []
    for path in training_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(2048)
        found = _DOCSTRING.match(head)
        if found:
            line = found.group(2).strip().strip('"\'').strip()
            if 12 <= len(line) <= 100 and len(line.split()) >= 3 and re.search(r"[a-z]{3}", line):
                topics.append(f"programming: {line.rstrip('.')}")
    return tuple(sorted(set(topics)))


def topic_sources() -> tuple[tuple[tuple[str, ...], float], ...]:
    """(topics, weight): everyday subjects half of the time, Python a fifth, the rest the
    standard library's modules (there are many more of those than of the others)."""
    return (SUBJECTS, 0.5), (pydoc_titles(), 0.2), (docstring_topics(), 0.3)


@dataclass(frozen=True)
class Plan:
    """What steers sample ``index``: drawn from its own seed only."""

    index: int
    seed: int  # seeds the sample's generations (seed, seed + 1, ...: one each)
    writer_system: str | None  # the system prompt the user turn is written under (None: the template's default)
    answer_system: str | None  # the one the answers are written under
    topic: str | None
    sampled: bool  # answers sampled (else greedy)
    followup: bool  # a second user turn, written by the model after its first answer


def sample_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"hasten-selfgen:{seed}:{index}")  # str seeds hash with sha512: stable everywhere


def plan(seed: int, index: int, sampled_share: float, followup_share: float) -> Plan:
    rng = sample_rng(seed, index)
    answer_system = rng.choice(PERSONAS) if rng.random() < PERSONA_SHARE else None
    if rng.random() < UNSTEERED_SHARE:
        topic, writer_system = None, answer_system
    else:
        sources = topic_sources()
        topic = rng.choice(rng.choices([s for s, _ in sources], [w for _, w in sources])[0])
        writer_system = f"You are a helpful assistant. In this conversation, {rng.choice(USERS).lower()} {rng.choice(TASKS)} {topic}."
    return Plan(index, rng.getrandbits(31), writer_system, answer_system, topic,
                rng.random() < sampled_share, rng.random() < followup_share)
