"""Published large training runs the planner is checked against (tests/test_plan.py asserts them
within 20%, bench/plan_published.py prints the ratios): each with its model, its layout, its
cluster and the throughput its authors reported.

Both ran Megatron, planned as the nearest of this stack's settings: its decoder layers hold
their q/k/v and fc1 weights as single fused tensors (`fused_projections` off: no
concatenation per pass), and its distributed optimizer reduce-scatters fp32 gradients once
(`--accumulate-allreduce-grads-in-fp32`, which Megatron turns on for bf16), the bytes of the
planner's ZeRO-1 all-reduce (two passes) in bf16: `ds` gives `communication_data_type` bf16.
`plan` takes `ds` as a run's resolved DeepSpeed JSON (`estimate(..., ds=run["ds"])`).
"""
from __future__ import annotations

from pretrain.config import ModelConfig, Recompute
from pretrain.resolve.layout import Layout
from pretrain.plan.clusters import make_cluster

# the bytes of Megatron's one fp32 reduce-scatter: the planner's all-reduce in bf16
MEGATRON_GRADIENTS = {"communication_data_type": "bf16"}

# Megatron-Core's 70B GPT benchmark: TP 8, PP 2, DP 48, vocab 131072, seq 4096, global batch 384
# on 768 H100: about 42% MFU, 420 TFLOP/s per GPU. Llama-3-70B shape, SP, distributed optimizer
# (ZeRO-1), no recomputation. Megatron splits the decoder layers evenly over the stages (40 and
# 40, the embedding on the first, the head on the last): here "type:DecoderLayerPipe".
MEGATRON_70B = dict(
    model=ModelConfig(vocab_size=131072, hidden_size=8192, num_layers=80, num_heads=64,
                      num_kv_heads=8, ffn_hidden_size=28672, seq_length=4096,
                      fused_projections=False),
    layout=Layout(tensor=8, pipeline=2, data=48, micro_batch=1, global_batch=384, zero_stage=1,
                  sequence_parallel=True, partition="type:DecoderLayerPipe"),
    cluster=make_cluster("h100-80gb", nodes=96), ds=MEGATRON_GRADIENTS, published_mfu=0.42,
    published_tflops=420.0)
# BLOOM-176B: 70 layers, hidden 14336, 112 heads, vocab 250880, seq 2048, global batch 2048, TP 4,
# PP 12, DP 8 on 384 A100-80GB, micro-batch 2, full recomputation, ZeRO-1: about 150 TFLOP/s per
# GPU counting recomputation. Its GPT block (4h GeLU MLP, 12 h^2 per layer) is given as a Llama
# block with the same parameters (SwiGLU inner size ~8h/3, divisible by TP); BLOOM ties its
# embeddings.
BLOOM_176B = dict(
    model=ModelConfig(vocab_size=250880, hidden_size=14336, num_layers=70, num_heads=112,
                      num_kv_heads=112, ffn_hidden_size=38228, seq_length=2048,
                      tie_embeddings=True, fused_projections=False),
    layout=Layout(tensor=4, pipeline=12, data=8, micro_batch=2, global_batch=2048, zero_stage=1,
                  recompute=Recompute.FULL),
    cluster=make_cluster("a100-80gb", nodes=48), ds=MEGATRON_GRADIENTS,
    published_hw_tflops=150.0)
