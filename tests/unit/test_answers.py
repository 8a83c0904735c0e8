"""answers.md's greedy answers (accel_trainer/contract/answers.py) stop at the characters asked for, or at the
tokens a recipe allows (grpo: its completions' length), instead of generating a token per character asked."""

import pytest

from accel_trainer.contract.answers import answers_page, greedy_answer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tiny_base):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_base).eval()


@pytest.mark.parametrize("max_chars", [12, 60])
def test_an_answer_stops_near_its_characters_and_is_cut_there(tiny_model, real_tokenizer, max_chars):
    calls = []
    generate = tiny_model.generate
    tiny_model.generate = lambda **kwargs: calls.append(generate(**kwargs)) or calls[-1]
    answer = greedy_answer(tiny_model, real_tokenizer, "The colour of the sky is", max_chars)

    assert len(answer) <= max_chars + 3 and answer.endswith("...")  # the random model never ends its text
    new_tokens = calls[0].shape[1] - len(real_tokenizer("The colour of the sky is")["input_ids"])
    assert new_tokens < max_chars  # stopped once the text was long enough, not at max_chars tokens


def test_an_answer_stops_at_its_tokens_and_a_page_lists_each_prompt_with_its_bullets(tiny_model, real_tokenizer):
    answer = greedy_answer(tiny_model, real_tokenizer, [{"role": "user", "content": "Hi"}], 500, max_tokens=3)
    assert len(real_tokenizer(answer, add_special_tokens=False)["input_ids"]) <= 4

    page = answers_page("Answers", [([{"role": "user", "content": "Hi"}], [f"model: {answer}"]), ("2+2=", ["4"])])
    assert page == f"# Answers\n\n**Hi**\n\n- model: {answer}\n\n**2+2=**\n\n- 4\n"
