"""An offline instruction-following corpus in the spirit of FedDPA's federated Flan datasets.

FedDPA (Long et al., NeurIPS 2024) builds each federated dataset from 8 Flan tasks, one task per
client, half classification and half generation, all in generative format with a distinct
instruction per dataset (its Tables 5-6). No Flan data is reachable here, so this module writes
8 tasks of the same kinds itself, from small word lists kept in this file:

==========================  ==============  ==============================================
task                        kind            Flan counterpart (FedDPA Table 5)
==========================  ==============  ==============================================
``paraphrase``              classification  glue_qqp / paws_wiki: do two sentences agree?
``entailment``              classification  snli: yes / no / it is not possible to tell
``sentiment``               classification  sentiment140: positive / negative
``question_classification`` classification  trec: location / person / number / date / reason
``structure_to_text``       generation      web_nlg_en: ``name[Ann], job[baker]`` -> sentence
``text_formatting``         generation      fix_punct: restore capitals and the full stop
``summarization``           generation      gigaword: a long sentence -> its gist
``word_sorting``            generation      word_sorting: sort words alphabetically
==========================  ==============  ==============================================

Choices. The word lists live in this module instead of being read from the standard library
(``calendar`` names follow the locale, docstrings change between Python versions), so a seed
gives the same corpus on every machine. Outputs are short (one to ten words) so that a tiny
language model pretrained in a minute on a CPU can learn them. Each task has three instruction
phrasings (Flan's templates vary likewise); like Flan, classification inputs list their
``OPTIONS``. Within a task no input occurs twice, and instructions differ between tasks, so
the splits below are disjoint by construction: no (instruction, input) of the public split is
held by any client, and no client's test example is in its train split.

Splits. ``public_split`` holds out the first ``public_fraction`` of every task (the corpus is
already in a seeded random order): the foundation model is pretrained on it and no client holds
any of it. Client ``i`` gets task ``INSTRUCTION_TASKS[i % 8]``, one task per client for the
default 8 clients as in FedDPA; with more clients, the clients sharing a task split its
non-public examples into disjoint, near-equal shares, and each client's test split is a
seeded ``test_fraction`` of its share.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

CORPUS_VERSION = 1  # bump when the generated text changes (it keys cached foundation models)
DEFAULT_EXAMPLES_PER_TASK = 200

GENERATION = "generation"
CLASSIFICATION = "classification"


@dataclass(frozen=True)
class Example:
    """One instruction-following example: the response to ``instruction`` on ``input``."""

    task: str
    instruction: str
    input: str
    output: str


@dataclass(frozen=True)
class Corpus:
    """Every task's examples, in a seeded random order."""

    seed: int
    by_task: dict[str, tuple[Example, ...]]

    def examples(self) -> tuple[Example, ...]:
        """All examples, task by task in ``INSTRUCTION_TASKS`` order."""
        return tuple(example for task in INSTRUCTION_TASKS for example in self.by_task[task])


# --- FedDPA's prompt (Table 7) ---------------------------------------------------------------

# Table 7 typesets the template as "Instruction: {instruction} Response:" with bold headers; the
# official code (Lydia-yang/FedDPA, code/templates/alpaca_short.json, "prompt_no_input", the
# template its README runs with) spells the exact string, Markdown headers and newlines included.
# FedDPA's Flan data has no separate input field: the instance text is part of the instruction.
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def format_prompt(instruction: str, input: str) -> str:
    """FedDPA's prompt (Table 7) for ``instruction`` on ``input``; the response follows it."""
    text = f"{instruction}\n{input}" if input else instruction
    return PROMPT_TEMPLATE.format(instruction=text)


# --- word lists ------------------------------------------------------------------------------

NAMES = (
    "Ann", "Bob", "Cara", "Dan", "Eva", "Finn", "Gina", "Hugo", "Ida", "Jon", "Kim", "Leo",
    "Mia", "Nils", "Olga", "Paul", "Rosa", "Sam", "Tina", "Uma", "Vera", "Will", "Zoe", "Max",
)  # fmt: skip
CITIES = (
    "Oslo", "Paris", "Rome", "Lima", "Cairo", "Delhi", "Tokyo", "Berlin", "Madrid", "Dublin",
    "Vienna", "Prague", "Lisbon", "Athens", "Quito", "Seoul",
)  # fmt: skip
JOBS = (
    "baker", "teacher", "doctor", "pilot", "farmer", "painter", "nurse", "writer", "chef",
    "lawyer", "singer", "dentist", "tailor", "driver", "sailor", "judge",
)  # fmt: skip
THINGS = (
    "book", "cake", "lamp", "bike", "letter", "ticket", "guitar", "basket", "map", "coat",
    "clock", "violin", "camera", "kettle", "radio", "table",
)  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
COLOURS = ("red", "blue", "green", "small", "new", "cheap", "heavy", "big", "tiny", "fine")
HOBBIES = ("music", "chess", "tennis", "poetry", "gardening", "cooking", "football", "films")
PLACES = ("market", "station", "library", "park", "harbour", "museum", "school", "cafe")
NUMBER_WORDS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
POSITIVE = (
    "wonderful", "great", "lovely", "excellent", "delightful", "superb", "pleasant", "amazing",
    "fantastic", "charming",
)  # fmt: skip
NEGATIVE = (
    "terrible", "awful", "boring", "horrible", "dreadful", "poor", "disappointing", "rude",
    "dirty", "miserable",
)  # fmt: skip
REVIEWED = (
    "food", "service", "room", "music", "staff", "film", "concert", "coffee", "trip", "show",
    "hotel", "lesson",
)  # fmt: skip
SORT_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "window", "pencil", "forest", "candle", "mirror",
    "island", "bridge", "rabbit", "honey", "planet", "ladder", "tiger", "violet", "meadow", "wagon",
    "anchor", "button", "desert", "engine", "feather", "kitten", "lemon", "needle", "orange",
    "pepper", "queen", "saddle", "tunnel", "velvet", "walnut", "yellow", "zebra", "marble",
)  # fmt: skip

# (past tense, recipient preposition, the same event seen from the recipient)
TRANSFERS = (
    ("gave", "to", "received", "from"),
    ("sold", "to", "bought", "from"),
    ("lent", "to", "borrowed", "from"),
    ("sent", "to", "got", "from"),
)


def _pick(rng: random.Random, pool: tuple[str, ...], count: int = 1) -> list[str]:
    """``count`` distinct items of ``pool``."""
    return rng.sample(pool, count)


# --- the tasks: each returns (input, output) for one random instance --------------------------


def _paraphrase(rng: random.Random) -> tuple[str, str]:
    """Two sentences about one transfer; the same meaning unless roles, thing or city change."""
    giver, taker = _pick(rng, NAMES, 2)
    thing, other_thing = _pick(rng, THINGS, 2)
    city, other_city = _pick(rng, CITIES, 2)
    give, to, receive, from_ = rng.choice(TRANSFERS)
    first = f"{giver} {give} a {thing} {to} {taker} in {city}."
    same = rng.random() < 0.5
    if same:
        second = rng.choice(
            (
                f"{taker} {receive} a {thing} {from_} {giver} in {city}.",
                f"In {city}, {giver} {give} {taker} a {thing}.",
                f"In {city}, {taker} {receive} a {thing} {from_} {giver}.",
            )
        )
    else:
        second = rng.choice(
            (
                f"{giver} {receive} a {thing} {from_} {taker} in {city}.",
                f"{taker} {receive} a {other_thing} {from_} {giver} in {city}.",
                f"In {other_city}, {giver} {give} {taker} a {thing}.",
            )
        )
    return f"{first}\n{second}\nOPTIONS:\n- no\n- yes", "yes" if same else "no"


def _entailment(rng: random.Random) -> tuple[str, str]:
    """A premise about a person and a hypothesis it entails, contradicts or leaves open."""
    name = rng.choice(NAMES)
    job, other_job = _pick(rng, JOBS, 2)
    city, other_city = _pick(rng, CITIES, 2)
    day, other_day = _pick(rng, DAYS, 2)
    place = rng.choice(PLACES)
    premise = f"{name}, a {job} from {city}, went to the {place} on {day}."
    label = rng.choice(("yes", "no", "it is not possible to tell"))
    hypotheses = {
        "yes": (f"{name} is a {job}.", f"{name} is from {city}.", f"{name} went out on {day}."),
        "no": (
            f"{name} is a {other_job}.",
            f"{name} is from {other_city}.",
            f"{name} stayed at home on {day}.",
            f"{name} went to the {place} on {other_day}.",
        ),
        "it is not possible to tell": (
            f"{name} likes {rng.choice(HOBBIES)}.",
            f"{name} has a {rng.choice(THINGS)}.",
            f"{name} met a {other_job} at the {place}.",
        ),
    }
    hypothesis = rng.choice(hypotheses[label])
    options = "OPTIONS:\n- yes\n- it is not possible to tell\n- no"
    return f"Premise: {premise}\nHypothesis: {hypothesis}\n{options}", label


def _sentiment(rng: random.Random) -> tuple[str, str]:
    """A short review whose adjectives carry one polarity."""
    positive = rng.random() < 0.5
    first, second = _pick(rng, POSITIVE if positive else NEGATIVE, 2)
    subject, other = _pick(rng, REVIEWED, 2)
    place = rng.choice(PLACES)
    text = rng.choice(
        (
            f"The {subject} at the {place} was {first}.",
            f"The {subject} was {first} and the {other} was {second}.",
            f"The {subject} was so {first}, and the {other} was {second} too.",
            f"I found the {subject} in {rng.choice(CITIES)} {first}.",
        )
    )
    return f"{text}\nOPTIONS:\n- negative\n- positive", "positive" if positive else "negative"


def _question_classification(rng: random.Random) -> tuple[str, str]:
    """A question and the type of its answer (TREC-like coarse classes)."""
    name, other = _pick(rng, NAMES, 2)
    job, thing, city = rng.choice(JOBS), rng.choice(THINGS), rng.choice(CITIES)
    label = rng.choice(("location", "person", "number", "date", "reason"))
    questions = {
        "location": (
            f"Where did {name} meet {other}?",
            f"In which city does the {job} live?",
            f"Where can {name} buy a {thing}?",
        ),
        "person": (
            f"Who sold the {thing} to {name}?",
            f"Which {job} visited {city}?",
            f"Who is the best {job} in {city}?",
        ),
        "number": (
            f"How many {thing}s did {name} buy?",
            f"How much does a {thing} cost in {city}?",
            f"How old is the {job} from {city}?",
        ),
        "date": (
            f"When did {name} arrive in {city}?",
            f"On which day does the {job} work?",
            f"What year was {name} born?",
        ),
        "reason": (
            f"Why did {name} leave {city}?",
            f"Why does the {job} need a {thing}?",
            f"What made {name} call {other}?",
        ),
    }
    options = "OPTIONS:\n- location\n- person\n- number\n- date\n- reason"
    return f"{rng.choice(questions[label])}\n{options}", label


def _structure_to_text(rng: random.Random) -> tuple[str, str]:
    """Attribute-value pairs about a person and the sentence that states them."""
    name, job, city = rng.choice(NAMES), rng.choice(JOBS), rng.choice(CITIES)
    fields = [f"name[{name}]", f"job[{job}]", f"city[{city}]"]
    sentence = f"{name} is a {job} from {city}"
    extra = rng.choice(("", "likes", "age"))
    if extra == "likes":
        hobby = rng.choice(HOBBIES)
        fields.append(f"likes[{hobby}]")
        sentence += f" who likes {hobby}"
    elif extra == "age":
        age = f"{rng.choice(('twenty', 'thirty', 'forty', 'fifty'))}-{rng.choice(NUMBER_WORDS)}"
        fields.append(f"age[{age}]")
        sentence += f" aged {age}"
    rng.shuffle(fields)
    return ", ".join(fields), sentence + "."


def _text_formatting(rng: random.Random) -> tuple[str, str]:
    """A sentence with its capitals and full stop removed, and the sentence itself."""
    name, other = _pick(rng, NAMES, 2)
    city, day, place = rng.choice(CITIES), rng.choice(DAYS), rng.choice(PLACES)
    sentence = rng.choice(
        (
            f"{name} met {other} in {city} on {day}.",
            f"On {day} {name} and {other} walked to the {place}.",
            f"{name} flew to {city} with {other}.",
            f"The {rng.choice(JOBS)} from {city} called {name} on {day}.",
        )
    )
    return sentence.rstrip(".").lower(), sentence


def _summarization(rng: random.Random) -> tuple[str, str]:
    """A long sentence about a transfer and its gist: who gave what to whom."""
    giver, taker = _pick(rng, NAMES, 2)
    thing, colour = rng.choice(THINGS), rng.choice(COLOURS)
    job, city = rng.choice(JOBS), rng.choice(CITIES)
    day, place = rng.choice(DAYS), rng.choice(PLACES)
    give, to, _, _ = rng.choice(TRANSFERS)
    text = rng.choice(
        (
            f"On {day}, {giver}, a {job} from {city}, {give} a {colour} {thing} {to} {taker} "
            f"at the busy {place}.",
            f"At the {place} in {city} last {day}, {giver} {give} a {colour} {thing} {to} "
            f"{taker}, a local {job}.",
            f"{giver}, who works as a {job} in {city}, {give} a {colour} {thing} {to} {taker} "
            f"near the {place} on {day}.",
        )
    )
    return text, f"{giver} {give} a {thing} {to} {taker}."


def _word_sorting(rng: random.Random) -> tuple[str, str]:
    """Three or four words and the same words in alphabetical order."""
    words = _pick(rng, SORT_WORDS, rng.randint(3, 4))
    return "List: " + " ".join(words), " ".join(sorted(words))


@dataclass(frozen=True)
class _Task:
    kind: str
    instructions: tuple[str, str, str]
    make: Callable[[random.Random], tuple[str, str]]


_TASKS: dict[str, _Task] = {
    "paraphrase": _Task(
        CLASSIFICATION,
        (
            "Do these two sentences mean the same thing?",
            "Are the following sentences paraphrases of each other?",
            "Is the second sentence a paraphrase of the first?",
        ),
        _paraphrase,
    ),
    "entailment": _Task(
        CLASSIFICATION,
        (
            "Does the premise entail the hypothesis?",
            "Can we conclude the hypothesis from the premise?",
            "Read the premise. Is the hypothesis true?",
        ),
        _entailment,
    ),
    "sentiment": _Task(
        CLASSIFICATION,
        (
            "What is the sentiment of this review?",
            "Is this review positive or negative?",
            "Classify the sentiment of the text.",
        ),
        _sentiment,
    ),
    "question_classification": _Task(
        CLASSIFICATION,
        (
            "What type of answer does this question ask for?",
            "Classify the question by the kind of answer it expects.",
            "Which category best describes the answer to this question?",
        ),
        _question_classification,
    ),
    "structure_to_text": _Task(
        GENERATION,
        (
            "Write a sentence that describes this data.",
            "Turn the following data into a sentence.",
            "Generate a sentence about this data.",
        ),
        _structure_to_text,
    ),
    "text_formatting": _Task(
        GENERATION,
        (
            "Add capital letters and punctuation to this text.",
            "Fix the capitalization and punctuation.",
            "Rewrite the text with correct capitals and a full stop.",
        ),
        _text_formatting,
    ),
    "summarization": _Task(
        GENERATION,
        (
            "Summarize this sentence in a few words.",
            "Write a short summary of the text.",
            "What is the gist of this sentence?",
        ),
        _summarization,
    ),
    "word_sorting": _Task(
        GENERATION,
        (
            "Sort these words alphabetically.",
            "Put the words in alphabetical order.",
            "Arrange the following words from A to Z.",
        ),
        _word_sorting,
    ),
}

INSTRUCTION_TASKS: tuple[str, ...] = tuple(_TASKS)
TASK_KINDS: dict[str, str] = {name: task.kind for name, task in _TASKS.items()}


def task_kind(task: str) -> str:
    """``"generation"`` or ``"classification"`` for a task name."""
    return TASK_KINDS[task]


def build_corpus(seed: int, examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK) -> Corpus:
    """Every task's ``examples_per_task`` examples (distinct inputs), generated from ``seed``."""
    by_task = {}
    for index, name in enumerate(INSTRUCTION_TASKS):
        rng = random.Random(f"fedfm-instructions:{seed}:{index}")
        task = _TASKS[name]
        examples: dict[str, Example] = {}
        attempts = 0
        while len(examples) < examples_per_task:
            attempts += 1
            if attempts > 50 * examples_per_task:
                raise ValueError(f"task {name!r} cannot make {examples_per_task} distinct inputs")
            text, output = task.make(rng)
            if text not in examples:
                instruction = rng.choice(task.instructions)
                examples[text] = Example(name, instruction, text, output)
        by_task[name] = tuple(examples.values())
    return Corpus(seed=seed, by_task=by_task)


def public_count(size: int, public_fraction: float) -> int:
    """How many of a task's ``size`` examples the public split holds."""
    if not 0.0 <= public_fraction < 1.0:
        raise ValueError(f"public_fraction must be in [0, 1), got {public_fraction}")
    return int(round(public_fraction * size))


def public_split(corpus: Corpus, public_fraction: float) -> tuple[Example, ...]:
    """The public split: the first ``public_fraction`` of every task, which no client holds."""
    held = []
    for task in INSTRUCTION_TASKS:
        examples = corpus.by_task[task]
        held.extend(examples[: public_count(len(examples), public_fraction)])
    return tuple(held)


def client_task(partition_id: int) -> str:
    """The task of client ``partition_id``: tasks are dealt to clients in turn."""
    return INSTRUCTION_TASKS[partition_id % len(INSTRUCTION_TASKS)]


def client_split(
    corpus: Corpus,
    partition_id: int,
    num_partitions: int,
    public_fraction: float,
    test_fraction: float,
    seed: int,
) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(train, test) of client ``partition_id``: its share of its task's non-public examples."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} is not in [0, {num_partitions})")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    task = client_task(partition_id)
    examples = corpus.by_task[task]
    private = examples[public_count(len(examples), public_fraction) :]
    tasks = len(INSTRUCTION_TASKS)
    sharers = len(range(partition_id % tasks, num_partitions, tasks))
    rank = partition_id // tasks
    start, stop = (len(private) * rank) // sharers, (len(private) * (rank + 1)) // sharers
    share = list(private[start:stop])
    random.Random(f"fedfm-instructions-test:{seed}:{partition_id}").shuffle(share)
    test_size = max(1, math.floor(test_fraction * len(share))) if share else 0
    return tuple(share[test_size:]), tuple(share[:test_size])
