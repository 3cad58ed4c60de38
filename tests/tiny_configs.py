"""Tiny Hugging Face configs shared by the tests that build real models (trace, FLOPs):
two-layer, narrow, so a CPU step takes well under a second."""

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
T5 = dict(model_type="t5", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2,
          num_heads=4, vocab_size=256)
WHISPER = dict(model_type="whisper", d_model=64, encoder_layers=1, decoder_layers=1,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
               decoder_ffn_dim=128, vocab_size=256, num_mel_bins=80, max_source_positions=50,
               max_target_positions=64, pad_token_id=1, bos_token_id=2, eos_token_id=2,
               decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[])
VIT = dict(model_type="vit", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, image_size=16, patch_size=8, num_labels=3)
BERT = dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=256, max_position_embeddings=64)
# DeepSeek-V3's layout in miniature: multi-head latent attention (q and kv latents, a rotary
# part, value heads narrower than q/k), one dense block then MoE blocks of 8 routed experts
# (top-2 from 1 of 2 groups) and a shared expert
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128,
                   moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                   vocab_size=256, max_position_embeddings=1024)
