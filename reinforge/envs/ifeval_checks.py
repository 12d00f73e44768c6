"""IFEval's verifiable instructions: one pure function per instruction type.

Each check takes the response and the instruction's kwargs, named exactly as in IFEval's data
(Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models",
arXiv:2311.07911), and says whether the response follows the instruction. `INSTRUCTIONS` maps
IFEval's instruction ids ("length_constraints:number_words") to the checks; `bind_instruction`
validates a record's kwargs and returns a one-argument check. All 25 types of the paper are here.

The semantics are IFEval's strict mode (its `check_following` methods), with these deviations:
- Sentences: IFEval counts them with NLTK's pretrained Punkt model. Here `count_sentences` is a
  rule-based approximation of Punkt's decisions: a sentence ends at `.`, `!`, `?` (runs allowed,
  closing quotes and brackets kept), followed by whitespace or the end of the text, except after a
  known abbreviation ("Dr.", "e.g.") or a one-letter initial followed by a capital ("J. Smith"); an
  ellipsis ends one only before a capital. As with Punkt, the "1." of a numbered list item ends a
  sentence and a line break alone does not. Counts can differ from Punkt's on unusual text.
- Capital words: IFEval tokenizes with NLTK's `word_tokenize`. Here a word is `\\w+` joined by `-`
  or `.` ("COVID-19", "U.S"), split at apostrophes ("DON'T" is two words, as NLTK's "DO" + "N'T").
- Keywords, forbidden words, section splitters and custom postscript markers are matched
  literally (`re.escape`); IFEval passes them to `re` unescaped. Same verdicts for plain words.
- A letter-frequency `letter` outside a-z ("#" and "!" occur in IFEval's data) is counted as given;
  IFEval replaces it with a random letter, so its verdict there is random.
- Language detection uses langdetect with a fixed seed (IFEval's call is unseeded, so repeated runs
  can disagree on short or mixed texts). As in IFEval, text langdetect cannot classify passes.
- kwargs with a None value are dropped (Hugging Face's copy of the data lists every kwarg of every
  type, None where unused); IFEval would draw a random value for them.
The empty-response rule of strict mode (a blank response follows nothing) is the caller's.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import re
from typing import Callable

from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory
from langdetect.lang_detect_exception import LangDetectException

from reinforge.errors import DataError

RELATIONS = ("less than", "at least")
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
INSTRUCTIONS: dict[str, Callable[..., bool]] = {}

# Lowercased tokens before a period that do not end a sentence (a subset of Punkt's English list).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc e.g i.e inc ltd co corp no approx fig dept est "
    "a.m p.m u.s u.k jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_CLOSERS = "\"'”’)]"  # closing quotes and brackets after a sentence's final punctuation
_WORD = re.compile(r"\w+")
_CAPITAL_WORD_TOKEN = re.compile(r"\w+(?:[-.]\w+)*")


def _instruction(instruction_id: str):
    def register(check: Callable[..., bool]) -> Callable[..., bool]:
        INSTRUCTIONS[instruction_id] = check
        return check

    return register


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def count_words(text: str) -> int:
    """Runs of word characters, as IFEval's `RegexpTokenizer(r"\\w+")`."""
    return len(_WORD.findall(text))


def count_sentences(text: str) -> int:
    """Sentences by the rules in the module doc (an approximation of NLTK Punkt)."""
    tokens = text.split()
    count, open_sentence = 0, False
    for i, token in enumerate(tokens):
        open_sentence = True
        core = token.rstrip(_CLOSERS)
        body = core.rstrip(".!?…")
        next_char = tokens[i + 1][:1] if i + 1 < len(tokens) else ""
        if body != core and _ends_sentence(body, core[len(body) :], next_char):
            count, open_sentence = count + 1, False
    return count + open_sentence


def _ends_sentence(body: str, punctuation: str, next_char: str) -> bool:
    """Whether a token `body + punctuation` followed by a word starting with `next_char` ends a sentence."""
    if punctuation == "…" or len(punctuation) > 1 and set(punctuation) == {"."}:  # an ellipsis
        return next_char.isupper()
    if punctuation != ".":
        return True
    body = body.lstrip("\"'“‘([").lower()
    if body in _ABBREVIATIONS:
        return False
    if len(body) == 1 and body.isalpha():  # an initial: "J. Smith", unless a lowercase word follows
        return not next_char.isupper()
    return True


@functools.cache
def _language_detectors() -> DetectorFactory:
    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(0)
    return factory


def detect_language(text: str) -> str | None:
    """langdetect's ISO 639-1 code for `text` (seeded), or None when it cannot tell."""
    detector = _language_detectors().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


# keywords:*


@_instruction("keywords:existence")
def keywords_existence(response: str, *, keywords: list[str]) -> bool:
    """Every keyword appears, as a case-insensitive substring."""
    return all(re.search(re.escape(keyword), response, re.IGNORECASE) for keyword in keywords)


@_instruction("keywords:frequency")
def keyword_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """Case-insensitive substring occurrences of `keyword` compared with `frequency`."""
    count = len(re.findall(re.escape(keyword.strip()), response, re.IGNORECASE))
    return _compare(count, relation, frequency)


@_instruction("keywords:forbidden_words")
def forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    """No forbidden word appears as a whole word, in any case."""
    return not any(re.search(rf"\b{re.escape(word)}\b", response, re.IGNORECASE) for word in forbidden_words)


@_instruction("keywords:letter_frequency")
def letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    """Occurrences of `letter`, case-insensitively, compared with `let_frequency`."""
    count = collections.Counter(response.lower())[letter.strip().lower()]
    return _compare(count, let_relation, let_frequency)


# language:*


@_instruction("language:response_language")
def response_language(response: str, *, language: str) -> bool:
    """langdetect finds `language` (ISO 639-1); text it cannot classify passes, as in IFEval."""
    detected = detect_language(response)
    return detected is None or detected == language


# length_constraints:*


@_instruction("length_constraints:number_sentences")
def number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(response), relation, num_sentences)


@_instruction("length_constraints:number_words")
def number_words(response: str, *, num_words: int, relation: str) -> bool:
    return _compare(count_words(response), relation, num_words)


@_instruction("length_constraints:number_paragraphs")
def number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Exactly `num_paragraphs` paragraphs separated by `***` dividers; blank paragraphs are only
    allowed first or last (and are not counted)."""
    paragraphs = re.split(r"\s?\*\*\*\s?", response)
    inner_blank = any(not p.strip() for p in paragraphs[1:-1])
    count = sum(bool(p.strip()) for p in paragraphs)
    return not inner_blank and count == num_paragraphs


@_instruction("length_constraints:nth_paragraph_first_word")
def nth_paragraph_first_word(response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Exactly `num_paragraphs` non-blank paragraphs separated by blank lines, and paragraph
    `nth_paragraph` starts with `first_word` (case-insensitive, leading quotes and trailing
    punctuation ignored). As in IFEval, `nth_paragraph` indexes the split including blank pieces."""
    paragraphs = response.split("\n\n")
    count = sum(bool(p.strip()) for p in paragraphs)
    if count != num_paragraphs or not 1 <= nth_paragraph <= count:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].lstrip("'").lstrip('"')
    return re.split(r"[.,?!'\"]", word, maxsplit=1)[0].lower() == first_word.lower()


# detectable_content:*


@_instruction("detectable_content:number_placeholders")
def number_placeholders(response: str, *, num_placeholders: int) -> bool:
    """At least `num_placeholders` square-bracket placeholders like `[address]` within one line.

    IFEval counts the matches of `\\[.*?\\]`, quadratic in a long line of "["; counting the
    innermost brackets instead gives the same count in linear time (a test holds this)."""
    return len(re.findall(r"\[[^\[\]\n]*\]", response)) >= num_placeholders


@_instruction("detectable_content:postscript")
def postscript(response: str, *, postscript_marker: str) -> bool:
    """The marker appears (case-insensitive); "P.S." and "P.P.S" also match with spaces ("p. s.").

    IFEval's patterns wrap these in `\\s*...*$`, which always matches and only costs quadratic
    time on long runs of whitespace."""
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    return re.search(pattern, response.lower()) is not None


# detectable_format:*


@_instruction("detectable_format:number_bullet_lists")
def number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` lines starting with `*` (not `**`) or `-` after optional whitespace.

    IFEval counts the matches of `^\\s*\\*[^\\*].*$` and `^\\s*-.*$` (multiline), quadratic in a long
    run of newlines; this walks the lines once for the same count (a test holds this), including
    IFEval's quirk that a line holding only `*` takes the next line as its text."""
    items = [line.lstrip() for line in response.split("\n")]
    count, i = sum(item.startswith("-") for item in items), 0
    while i < len(items):
        if items[i].startswith("*") and items[i][1:2] != "*" and (len(items[i]) > 1 or i + 1 < len(items)):
            count += 1
            i += len(items[i]) == 1  # `[^*]` matched the newline: the next line is this star's text
        i += 1
    return count == num_bullets


@_instruction("detectable_format:constrained_response")
def constrained_response(response: str) -> bool:
    """Contains one of "My answer is yes.", "My answer is no.", "My answer is maybe."."""
    return any(option in response for option in CONSTRAINED_RESPONSES)


@_instruction("detectable_format:number_highlighted_sections")
def number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` non-blank `*italic*` or `**bold**` spans within one line."""
    singles = re.findall(r"\*[^\n*]*\*", response)
    doubles = re.findall(r"\*\*[^\n*]*\*\*", response)
    count = sum(bool(s.strip("*").strip()) for s in singles)
    count += sum(bool(d[2:-2].strip()) for d in doubles)
    return count >= num_highlights


@_instruction("detectable_format:multiple_sections")
def multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least `num_sections` headers "<spliter> <number>" (case-sensitive), e.g. "SECTION 1"."""
    pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(pattern, response)) - 1 >= num_sections


@_instruction("detectable_format:json_format")
def json_format(response: str) -> bool:
    """The whole response parses as JSON, optionally inside one ``` (```json) fence. JSON nested
    deeper than Python's recursion limit does not count (IFEval's check raises on it)."""
    text = response.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(fence)
    try:
        json.loads(text.removesuffix("```").strip())
    except (ValueError, RecursionError):
        return False
    return True


@_instruction("detectable_format:title")
def title(response: str) -> bool:
    """A non-blank title in double angular brackets on one line: `<<poem of joy>>`.

    IFEval's `<<[^\\n]+>>` matches at most once per line, from its first `<<` to its last `>>`;
    finding those directly avoids its quadratic time on a long line of "<" (a test holds this)."""
    for line in response.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start != -1 and end >= start + 3 and line[start : end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


# combination:*


@_instruction("combination:two_responses")
def two_responses(response: str) -> bool:
    """Two different non-blank responses separated by `******` (blank ends allowed)."""
    parts = response.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    answers = [p.strip() for p in parts if p.strip()]
    return len(answers) == 2 and answers[0] != answers[1]


@_instruction("combination:repeat_prompt")
def repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    """Starts with the request, repeated word for word (case and surrounding blanks ignored)."""
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


# startend:*


@_instruction("startend:end_checker")
def end_checker(response: str, *, end_phrase: str) -> bool:
    """Ends with `end_phrase` (case-insensitive; trailing blanks and double quotes ignored)."""
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


@_instruction("startend:quotation")
def quotation(response: str) -> bool:
    """Wrapped in double quotation marks."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# change_case:*


@_instruction("change_case:capital_word_frequency")
def capital_word_frequency(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    """Words in all capitals ("I", "NASA", "COVID-19") compared with `capital_frequency`."""
    count = sum(word.isupper() for word in _CAPITAL_WORD_TOKEN.findall(response))
    return _compare(count, capital_relation, capital_frequency)


@_instruction("change_case:english_capital")
def english_capital(response: str) -> bool:
    """Has cased letters, all capitals, and langdetect says English (or cannot tell)."""
    return response.isupper() and detect_language(response) in ("en", None)


@_instruction("change_case:english_lowercase")
def english_lowercase(response: str) -> bool:
    """Has cased letters, all lowercase, and langdetect says English (or cannot tell)."""
    return response.islower() and detect_language(response) in ("en", None)


# punctuation:*


@_instruction("punctuation:no_comma")
def no_comma(response: str) -> bool:
    return "," not in response


def bind_instruction(instruction_id: str, kwargs: dict) -> Callable[[str], bool]:
    """The check for `instruction_id` with `kwargs` applied; a DataError names what is wrong."""
    if instruction_id not in INSTRUCTIONS:
        raise DataError(
            f"unknown IFEval instruction id {instruction_id!r}; supported: {', '.join(sorted(INSTRUCTIONS))}"
        )
    check = INSTRUCTIONS[instruction_id]
    given = {name: value for name, value in kwargs.items() if value is not None}
    expected = _kwarg_types(instruction_id)
    if given.keys() != expected.keys():
        unknown, missing = sorted(given.keys() - expected.keys()), sorted(expected.keys() - given.keys())
        raise DataError(
            f"IFEval instruction {instruction_id!r} takes kwargs {sorted(expected) or 'none'}; "
            f"got unknown {unknown} and missing {missing}"
        )
    for name, value in given.items():
        _validate_kwarg(instruction_id, name, value, expected[name])
    return functools.partial(check, **given)


@functools.cache
def _kwarg_types(instruction_id: str) -> dict[str, str]:
    parameters = inspect.signature(INSTRUCTIONS[instruction_id]).parameters.values()
    return {p.name: p.annotation for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _validate_kwarg(instruction_id: str, name: str, value, annotation: str) -> None:
    if annotation == "int":
        valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        wanted = "a non-negative integer"
    elif name.endswith("relation"):
        valid, wanted = value in RELATIONS, f"one of {list(RELATIONS)}"
    elif annotation == "str":
        valid, wanted = isinstance(value, str) and bool(value.strip()), "a non-empty string"
    else:
        assert annotation == "list[str]", annotation
        valid = isinstance(value, list) and all(isinstance(item, str) and item.strip() for item in value)
        wanted = "a list of non-empty strings"
    if not valid:
        raise DataError(f"IFEval instruction {instruction_id!r}: kwarg {name!r} must be {wanted}, got {value!r}")
