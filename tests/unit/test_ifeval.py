import json
from pathlib import Path

import pydantic
import pytest

from reinforge.envs.base import EnvRequest
from reinforge.envs.ifeval import IfEvalConfig, IfEvalEnv
from reinforge.envs.ifeval_checks import INSTRUCTIONS, bind_instruction, count_sentences, count_words
from reinforge.errors import DataError

IFEVAL_DATA = Path(__file__).resolve().parents[2] / "data" / "benchmarks" / "ifeval" / "input_data.jsonl"
# Instruction ids in IFEval's input_data.jsonl that IfEvalEnv does not implement: none.
UNSUPPORTED_IDS: set[str] = set()


def follows(instruction_id: str, response: str, **kwargs) -> bool:
    return bind_instruction(instruction_id, kwargs)(response)


def request(response: str, ids: list[str], kwargs: list[dict], **record) -> EnvRequest:
    return EnvRequest(
        messages=[{"role": "user", "content": "prompt"}, {"role": "assistant", "content": response}],
        record={"instruction_id_list": ids, "kwargs": kwargs, **record},
    )


# keywords:*


def test_every_keyword_must_appear_case_insensitively_even_inside_words():
    kwargs = {"keywords": ["river", "Land"]}
    assert follows("keywords:existence", "The RIVER crosses the landscape.", **kwargs)
    assert not follows("keywords:existence", "The river crosses the valley.", **kwargs)


def test_keywords_are_matched_literally_not_as_regular_expressions():
    assert follows("keywords:existence", "I write C++ daily.", keywords=["c++"])
    assert not follows("keywords:existence", "I write C daily.", keywords=["c++"])


def test_keyword_frequency_counts_substrings_against_the_relation():
    text = "Fake news, fake smiles, and a faker."  # "fake" three times, once inside "faker"
    assert follows("keywords:frequency", text, keyword="fake", frequency=3, relation="at least")
    assert not follows("keywords:frequency", text, keyword="fake", frequency=4, relation="at least")
    assert follows("keywords:frequency", text, keyword="fake", frequency=4, relation="less than")
    assert not follows("keywords:frequency", text, keyword="fake", frequency=3, relation="less than")


def test_forbidden_words_are_matched_as_whole_words_in_any_case():
    kwargs = {"forbidden_words": ["rock", "can"]}
    assert follows("keywords:forbidden_words", "Rocky shores and a canal.", **kwargs)
    assert not follows("keywords:forbidden_words", "We sat on a ROCK.", **kwargs)
    assert not follows("keywords:forbidden_words", "Yes we can!", **kwargs)


def test_letter_frequency_counts_the_letter_in_both_cases():
    text = "Quick quiet quails"  # q three times
    assert follows("keywords:letter_frequency", text, letter="q", let_frequency=3, let_relation="at least")
    assert not follows("keywords:letter_frequency", text, letter="q", let_frequency=4, let_relation="at least")
    assert follows("keywords:letter_frequency", text, letter="Q", let_frequency=4, let_relation="less than")
    assert not follows("keywords:letter_frequency", text, letter="q", let_frequency=3, let_relation="less than")


def test_a_non_letter_in_letter_frequency_is_counted_as_given():
    assert follows("keywords:letter_frequency", "#a #b", letter="#", let_frequency=2, let_relation="at least")
    assert not follows("keywords:letter_frequency", "#a b", letter="#", let_frequency=2, let_relation="at least")


# language:*


def test_the_response_language_is_detected():
    german = "Heute ist ein schöner Tag, und wir gehen zusammen in den Park, um die Sonne zu genießen."
    english = "Today is a beautiful day, and we are going to the park together to enjoy the sunshine."
    assert follows("language:response_language", german, language="de")
    assert not follows("language:response_language", english, language="de")


def test_text_whose_language_cannot_be_detected_passes_as_in_ifeval():
    assert follows("language:response_language", "12345 !!!", language="hi")


# length_constraints:*


def test_words_are_runs_of_word_characters():
    assert count_words("Hello, world! It's a well-known fact.") == 8  # It, s, well, known split apart
    assert follows("length_constraints:number_words", "one two three", num_words=3, relation="at least")
    assert not follows("length_constraints:number_words", "one two", num_words=3, relation="at least")
    assert follows("length_constraints:number_words", "one two", num_words=3, relation="less than")
    assert not follows("length_constraints:number_words", "one two three", num_words=3, relation="less than")


def test_sentences_end_at_terminal_punctuation_but_not_after_abbreviations_or_initials():
    assert count_sentences("Hello world. How are you? Fine!") == 3
    assert count_sentences("Dr. Smith met J. Doe in the U.S. today. They talked.") == 2
    assert count_sentences('He said "Stop." Then he left.') == 2
    assert count_sentences("Pi is 3.14 exactly. Or not.") == 2
    assert count_sentences("Wait... what? Well... Okay.") == 3  # "Wait... what?" is one sentence
    assert count_sentences("a line\nanother line without a stop") == 1
    assert count_sentences("") == 0


def test_number_sentences_compares_the_count_with_the_relation():
    text = "One. Two. Three."
    assert follows("length_constraints:number_sentences", text, num_sentences=3, relation="at least")
    assert not follows("length_constraints:number_sentences", text, num_sentences=4, relation="at least")
    assert follows("length_constraints:number_sentences", text, num_sentences=4, relation="less than")
    assert not follows("length_constraints:number_sentences", text, num_sentences=3, relation="less than")


def test_paragraphs_are_separated_by_markdown_dividers():
    assert follows("length_constraints:number_paragraphs", "First.\n***\nSecond.\n***\nThird.", num_paragraphs=3)
    assert follows("length_constraints:number_paragraphs", "***\nFirst.\n***\nSecond.\n***", num_paragraphs=2)
    assert not follows("length_constraints:number_paragraphs", "First.\n***\nSecond.", num_paragraphs=3)
    assert not follows("length_constraints:number_paragraphs", "First.\n\nSecond.\n\nThird.", num_paragraphs=3)


def test_an_empty_paragraph_between_dividers_fails():
    assert not follows("length_constraints:number_paragraphs", "First.\n***\n***\nSecond.", num_paragraphs=2)


def test_the_nth_paragraph_must_start_with_the_word_and_the_paragraph_count_must_match():
    kwargs = {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "Summary"}
    assert follows("length_constraints:nth_paragraph_first_word", 'Intro.\n\n"summary, then.\n\nEnd.', **kwargs)
    assert not follows("length_constraints:nth_paragraph_first_word", "Intro.\n\nIn summary.\n\nEnd.", **kwargs)
    assert not follows("length_constraints:nth_paragraph_first_word", "Intro.\n\nSummary here.", **kwargs)


def test_a_paragraph_index_past_the_last_paragraph_fails():
    kwargs = {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "end"}
    assert not follows("length_constraints:nth_paragraph_first_word", "Start.\n\nEnd.", **kwargs)


# detectable_content:*


def test_placeholders_are_square_bracketed():
    assert follows("detectable_content:number_placeholders", "Dear [name], at [address].", num_placeholders=2)
    assert not follows("detectable_content:number_placeholders", "Dear [name], at home.", num_placeholders=2)


def test_a_postscript_starts_with_its_marker():
    assert follows("detectable_content:postscript", "Bye.\n\nP.S. See you soon.", postscript_marker="P.S.")
    assert follows("detectable_content:postscript", "Bye.\np. p. s. one more", postscript_marker="P.P.S")
    assert not follows("detectable_content:postscript", "Bye.\nPS see you soon.", postscript_marker="P.S.")
    assert not follows("detectable_content:postscript", "Bye.\nP.S. see you.", postscript_marker="P.P.S")


def test_a_custom_postscript_marker_is_matched_literally():
    assert follows("detectable_content:postscript", "Done.\nNote: one more thing", postscript_marker="Note:")
    assert not follows("detectable_content:postscript", "Done.\nNotes one more thing", postscript_marker="Note:")


# detectable_format:*


def test_bullets_are_star_or_dash_lines_and_their_count_must_be_exact():
    assert follows("detectable_format:number_bullet_lists", "Intro\n* one\n- two\n  * three", num_bullets=3)
    assert not follows("detectable_format:number_bullet_lists", "* one\n* two", num_bullets=3)
    assert not follows("detectable_format:number_bullet_lists", "* one\n* two\n* three\n* four", num_bullets=3)
    assert not follows("detectable_format:number_bullet_lists", "**bold** line\n* one", num_bullets=2)


def test_a_constrained_response_contains_one_of_the_options():
    assert follows("detectable_format:constrained_response", "After thought: My answer is maybe.")
    assert not follows("detectable_format:constrained_response", "My answer is probably yes.")


def test_highlights_count_italic_and_bold_spans():
    assert follows("detectable_format:number_highlighted_sections", "*one* and **two**", num_highlights=2)
    assert not follows("detectable_format:number_highlighted_sections", "*one* and ** ** and **", num_highlights=2)
    assert not follows("detectable_format:number_highlighted_sections", "*spans\ntwo lines*", num_highlights=1)


def test_sections_start_with_the_splitter_and_a_number():
    text = "SECTION 1\nIntro.\nSECTION 2\nBody."
    assert follows("detectable_format:multiple_sections", text, section_spliter="SECTION", num_sections=2)
    assert not follows("detectable_format:multiple_sections", text, section_spliter="SECTION", num_sections=3)
    assert not follows("detectable_format:multiple_sections", text, section_spliter="Section", num_sections=2)


def test_json_may_be_wrapped_in_a_code_fence():
    assert follows("detectable_format:json_format", '```json\n{"a": [1, 2]}\n```')
    assert follows("detectable_format:json_format", ' {"a": 1} ')
    assert not follows("detectable_format:json_format", 'Here it is: {"a": 1}')
    assert not follows("detectable_format:json_format", "{'a': 1}")


def test_json_nested_past_the_recursion_limit_is_not_json_rather_than_an_error():
    assert not follows("detectable_format:json_format", "[" * 100_000)


def test_a_title_is_wrapped_in_double_angular_brackets():
    assert follows("detectable_format:title", "<<Poem of Joy>>\nRoses are red.")
    assert not follows("detectable_format:title", "<< >>\nRoses are red.")
    assert not follows("detectable_format:title", "<<Poem\nof Joy>>")


# combination:*


def test_two_responses_are_different_and_separated_by_six_asterisks():
    assert follows("combination:two_responses", "First answer.\n******\nSecond answer.")
    assert not follows("combination:two_responses", "Same answer.\n******\nSame answer.")
    assert not follows("combination:two_responses", "One.\n******\n******\nTwo.")
    assert not follows("combination:two_responses", "Only one answer.")


def test_the_prompt_must_be_repeated_first_ignoring_case():
    prompt = "Write a poem about the sea."
    response = "  write a poem about the sea. The waves..."
    assert follows("combination:repeat_prompt", response, prompt_to_repeat=prompt)
    assert not follows("combination:repeat_prompt", "Sure! Write a poem about the sea.", prompt_to_repeat=prompt)


# startend:*


def test_the_response_must_end_with_the_phrase():
    phrase = "Is there anything else I can help with?"
    assert follows("startend:end_checker", 'Done. is there anything else I can help with?"\n', end_phrase=phrase)
    assert not follows("startend:end_checker", f"{phrase} Bye.", end_phrase=phrase)


def test_the_whole_response_must_be_in_double_quotes():
    assert follows("startend:quotation", '  "Hello there."  ')
    assert not follows("startend:quotation", '"Hello" there.')
    assert not follows("startend:quotation", '"')


# change_case:*


def test_capital_words_include_single_letters_acronyms_and_hyphenated_words():
    text = "I think NASA and COVID-19 matter, DON'T they?"  # I, NASA, COVID-19, DON, T
    check = "change_case:capital_word_frequency"
    assert follows(check, text, capital_frequency=5, capital_relation="at least")
    assert not follows(check, text, capital_frequency=6, capital_relation="at least")
    assert follows(check, text, capital_frequency=6, capital_relation="less than")
    assert not follows(check, text, capital_frequency=5, capital_relation="less than")


def test_all_capitals_means_no_lowercase_letter_and_english():
    assert follows("change_case:english_capital", "THIS IS MY ANSWER, AND IT IS WRITTEN IN ENGLISH.")
    assert not follows("change_case:english_capital", "THIS IS MY ANSWER, and it is mixed.")
    # langdetect reads capitalised Latin-script text as English whatever the language, so the
    # non-English case is Cyrillic.
    russian = "ЭТО МОЙ ОТВЕТ НА РУССКОМ ЯЗЫКЕ, И ОН НАПИСАН ЗАГЛАВНЫМИ БУКВАМИ."
    assert not follows("change_case:english_capital", russian)


def test_all_lowercase_means_no_capital_letter_and_english():
    assert follows("change_case:english_lowercase", "this is my answer, and it is written in english.")
    assert not follows("change_case:english_lowercase", "This is my answer, and it is written in english.")
    german = "das ist meine antwort, und sie ist auf deutsch geschrieben."
    assert not follows("change_case:english_lowercase", german)


# punctuation:*


def test_no_comma_means_not_a_single_comma():
    assert follows("punctuation:no_comma", "No commas here. None at all!")
    assert not follows("punctuation:no_comma", "Well, one.")


# kwargs validation


def test_unknown_and_missing_kwargs_are_data_errors_naming_the_kwarg():
    with pytest.raises(DataError, match="unknown \\['num_word'\\] and missing \\['num_words'\\]"):
        bind_instruction("length_constraints:number_words", {"num_word": 3, "relation": "at least"})


def test_a_relation_outside_less_than_and_at_least_is_a_data_error():
    with pytest.raises(DataError, match="'relation' must be one of"):
        bind_instruction("length_constraints:number_words", {"num_words": 3, "relation": "at most"})


def test_a_non_integer_count_is_a_data_error():
    with pytest.raises(DataError, match="'num_bullets' must be a non-negative integer"):
        bind_instruction("detectable_format:number_bullet_lists", {"num_bullets": "3"})


def test_kwargs_set_to_none_are_ignored():
    check = bind_instruction("punctuation:no_comma", {"num_words": None, "relation": None})
    assert check("no comma")


# the environment


def test_reward_all_pays_only_when_every_instruction_is_followed():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    ids = ["punctuation:no_comma", "length_constraints:number_words"]
    kwargs = [{}, {"relation": "at least", "num_words": 3}]
    good, bad = env.step([request("one two three", ids, kwargs), request("one, two", ids, kwargs)])
    assert (good.reward, good.components, good.info) == (
        1.0,
        {"punctuation:no_comma": 1.0, "length_constraints:number_words": 1.0},
        {"failed": []},
    )
    assert (bad.reward, bad.components, bad.info) == (
        0.0,
        {"punctuation:no_comma": 0.0, "length_constraints:number_words": 0.0},
        {"failed": ["punctuation:no_comma", "length_constraints:number_words"]},
    )


def test_reward_fraction_pays_the_fraction_of_instructions_followed():
    env = IfEvalEnv(IfEvalConfig(reward="fraction"))
    ids = ["punctuation:no_comma", "length_constraints:number_words"]
    kwargs = [{}, {"relation": "at least", "num_words": 3}]
    [response] = env.step([request("one two", ids, kwargs)])  # no comma, but only two words
    assert response.reward == 0.5
    assert response.info == {"failed": ["length_constraints:number_words"]}


def test_a_repeated_instruction_id_gets_numbered_component_keys():
    env = IfEvalEnv(IfEvalConfig(reward="fraction"))
    ids = ["length_constraints:number_words", "length_constraints:number_words"]
    kwargs = [{"relation": "at least", "num_words": 2}, {"relation": "less than", "num_words": 3}]
    [inside, outside] = env.step([request("one two", ids, kwargs), request("one two three", ids, kwargs)])
    assert inside.components == {"length_constraints:number_words": 1.0, "length_constraints:number_words#2": 1.0}
    assert outside.info == {"failed": ["length_constraints:number_words#2"]}
    assert outside.reward == 0.5


def test_a_blank_response_follows_no_instruction_as_in_strict_mode():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    [response] = env.step([request("  \n", ["punctuation:no_comma"], [{}])])
    assert response.reward == 0.0


def test_the_response_is_the_last_assistant_message():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    messages = [
        {"role": "user", "content": "prompt"},
        {"role": "assistant", "content": "a, b"},
        {"role": "user", "content": "again, without commas"},
        {"role": "assistant", "content": "a b"},
    ]
    record = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert env.step([EnvRequest(messages=messages, record=record)])[0].reward == 1.0


def test_repeat_prompt_falls_back_to_the_records_prompt():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    [response] = env.step([request("Say hi. Hi!", ["combination:repeat_prompt"], [{}], prompt="Say hi.")])
    assert response.reward == 1.0


def test_metrics_give_follow_rates_per_instruction_since_the_last_call():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    ids = ["punctuation:no_comma", "startend:quotation"]
    env.step([request('"a b"', ids, [{}, {}]), request('"a, b"', ids, [{}, {}]), request("a b", ids[:1], [{}])])
    assert env.metrics() == {
        "follow_rate/punctuation:no_comma": 2 / 3,
        "follow_rate/startend:quotation": 1.0,
        "prompt_follow_rate": 2 / 3,  # the second response has a comma
        "instruction_follow_rate": 4 / 5,
    }
    assert env.metrics() == {}


def test_an_unknown_instruction_id_is_a_data_error_naming_it_and_the_supported_ones():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    supported = "supported: change_case:capital_word_frequency, change_case:english_capital"
    with pytest.raises(DataError, match=f"'detectable_format:haiku'.*{supported}"):
        env.step([request("text", ["punctuation:no_comma", "detectable_format:haiku"], [{}, {}])])
    assert env.metrics() == {}  # nothing of the failed batch was counted


def test_kwargs_must_parallel_the_instruction_ids():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    with pytest.raises(DataError, match="'kwargs' has 1 entries for 2 instruction ids"):
        env.step([request("text", ["punctuation:no_comma", "startend:quotation"], [{}])])


def test_a_record_without_instructions_is_a_data_error():
    env = IfEvalEnv(IfEvalConfig(reward="all"))
    with pytest.raises(DataError, match="instruction_id_list"):
        env.step([EnvRequest(messages=[{"role": "assistant", "content": "x"}], record={"answer": "1"})])


def test_the_reward_mode_must_be_all_or_fraction():
    with pytest.raises(pydantic.ValidationError, match="reward"):
        IfEvalConfig(reward="mean")


def test_all_25_ifeval_instruction_types_are_implemented():
    assert len(INSTRUCTIONS) == 25


def test_every_ifeval_benchmark_record_is_supported_and_its_kwargs_bind():
    records = [json.loads(line) for line in IFEVAL_DATA.read_text().splitlines()]
    assert len(records) == 541
    unsupported = {i for record in records for i in record["instruction_id_list"] if i not in INSTRUCTIONS}
    assert unsupported == UNSUPPORTED_IDS
    env = IfEvalEnv(IfEvalConfig(reward="fraction"))
    supported = [r for r in records if not set(r["instruction_id_list"]) & UNSUPPORTED_IDS]
    requests = [request("A response.", r["instruction_id_list"], r["kwargs"], prompt=r["prompt"]) for r in supported]
    responses = env.step(requests)
    assert all(0.0 <= response.reward <= 1.0 for response in responses)
