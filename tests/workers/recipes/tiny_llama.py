"""`tiny_llama`: hf_causal_lm's data and loss on a 2-layer transformers Llama made from its config, with no
`tp_plan` or `wrap_classes` of its own: tensor parallelism takes the plan the model declares (its config's
`base_model_tp_plan`), FSDP its `_no_split_modules`."""

import accel_trainer as at

HFCausalLM = at.get_recipe("hf_causal_lm")


@at.register_recipe("tiny_llama")
class TinyLlama(HFCausalLM):  # type: ignore[misc]
    wrap_classes = ()
    tp_plan = {}

    def build_model(self, cfg):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=cfg.block_size, bos_token_id=256, eos_token_id=256,
            pad_token_id=256, tie_word_embeddings=False,
        )  # fmt: skip
        return LlamaForCausalLM(config)
