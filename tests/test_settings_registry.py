"""Every setting names the test that fails when the setting is silently ignored.

REGISTRY maps each run-config field (found by walking pretrain/config.py's dataclasses) and each
DeepSpeed key the shipped JSONs or the resolver set to "tests/<file>.py::<function>": a test
that observes the setting's effect (numerics against a reference, bytes or memory measured, a
code path counted, a value read back from the built engine). A setting with no such test yet sits
in GAPS with its reason; GAPS may only shrink (FROZEN_GAPS), so a new field needs a test.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

from pretrain import config as run_config

ROOT = Path(__file__).resolve().parent.parent
DS = "deepspeed:"  # prefix of DeepSpeed key paths, e.g. "deepspeed:zero_optimization.stage"

T_SPIKE_FACTOR = "tests/test_spikes.py::test_a_loss_under_the_configured_factor_is_no_spike"
T_ADAM = "tests/test_config.py::test_adams_betas_and_eps_reach_the_optimizer"
T_MODEL_HF = "tests/test_model.py::test_logits_and_loss_match_hugging_face"
T_FAMILY_HF = "tests/test_families.py::test_imported_family_model_is_transformers_and_exports_back"
T_LLAMA3_ROPE = "tests/test_families.py::test_llama3_frequencies_are_transformers"
T_ZERO_FP32 = "tests/test_train_zero.py::test_zero_stage_matches_single_process_fp32"
T_TP_ZERO1 = "tests/test_tensor_parallel.py::test_deepspeed_zero1_tp2_dp2_matches_single_rank"
# the resolved DeepSpeed JSON read back (a micro-batch size changes no fp32 loss: only the read
# back can show it ignored)
T_TIMEOUTS = "tests/test_train_zero.py::test_the_process_groups_have_the_configured_timeouts"
T_SHIPPED_DS = "tests/test_config.py::test_shipped_ds_configs_resolve_completely"
T_BF16_FP32_SUMS = "tests/test_train_zero.py::test_bf16_sums_128_micro_batch_gradients_in_fp32"
T_MOE_LAYER = ("tests/test_moe.py::"
               "test_moe_layer_matches_a_per_token_reference_in_output_losses_and_gradients")
T_EVAL = "tests/test_eval.py::test_in_run_scores_equal_hflms_on_the_exported_checkpoint"
T_E2E = "tests/test_e2e.py::test_deepspeed_launcher_zero2_trains_checkpoints_and_generates"
T_PINNED = "tests/test_ds_knobs.py::test_offload_pins_the_host_buffers_its_pin_memory_settings_name"
T_ZERO2_BUFFERS = ("tests/test_ds_knobs.py::"
                   "test_zero2_contiguous_gradients_and_overlap_comm_build_the_bucket_buffers")
T_LOGGED = "tests/test_ds_knobs.py::test_steps_per_print_sets_deepspeeds_progress_line_cadence"
T_NVME = "tests/test_ds_knobs.py::test_nvme_swappers_are_built_with_the_aio_and_buffer_settings"
# the engine `pretrain train` builds, read back (step 1's loss, cited before, is the same whatever
# the lr or the clipping)
T_BUILT_ENGINE = ("tests/test_bite_engine.py::"
                  "test_the_built_engine_has_the_runs_lr_and_gradient_clipping")
# every tests/test_mup.py model has the proxy width 64: a rule reading 64 instead passes there
T_MUP_BASES = ("tests/test_bite_mup.py::"
               "test_the_base_width_and_base_head_dim_set_the_groups_and_the_attention_scale")

T_MUON_HAND = "tests/test_muon.py::test_one_process_equals_torch_muon_and_adamw_by_hand"

REGISTRY: dict[str, str] = {
    # run config: top level
    "run_dir": "tests/test_checkpoint.py::test_resume_gives_bitwise_the_same_losses",
    "deepspeed": "tests/test_train_zero.py::test_zero3_matches_single_process_fp32",
    # model.*
    "model.preset": T_MODEL_HF,
    "model.vocab_size": T_MODEL_HF,
    "model.hidden_size": T_MODEL_HF,
    "model.num_layers": T_MODEL_HF,
    "model.num_heads": T_MODEL_HF,
    "model.num_kv_heads": T_MODEL_HF,
    "model.ffn_hidden_size": T_MODEL_HF,
    "model.seq_length": "tests/test_data.py::test_packed_samples_cover_the_stream_and_split_documents",
    "model.rope_theta": "tests/test_model.py::test_rope_theta_and_norm_eps_reach_the_layers",
    "model.family": T_FAMILY_HF,
    "model.head_dim": T_FAMILY_HF,
    "model.rope_scaling": T_LLAMA3_ROPE,
    "model.rope_scaling_factor": T_LLAMA3_ROPE,
    "model.rope_low_freq_factor": T_LLAMA3_ROPE,
    "model.rope_high_freq_factor": T_LLAMA3_ROPE,
    "model.rope_original_max_positions": T_LLAMA3_ROPE,
    "model.norm_eps": "tests/test_model.py::test_rope_theta_and_norm_eps_reach_the_layers",
    "model.tie_embeddings": T_MODEL_HF,
    "model.init_std": "tests/test_model.py::test_init_statistics_scale_output_projections",
    "model.activation_checkpointing":
        "tests/test_train_zero.py::test_activation_checkpointing_under_zero3_recomputes_and_gives_the_same_losses",
    "model.activation_checkpointing_interval":
        "tests/test_telemetry.py::test_hardware_flops_count_recomputed_forwards",
    "model.vocab_pad_multiple": "tests/test_model.py::test_init_is_per_name_and_independent_of_padding",
    "model.init_from": "tests/test_hf_interop.py::test_first_training_step_after_import_matches_transformers",
    "model.compile": "tests/test_compile.py::test_a_restarted_run_reuses_its_compiled_kernels",
    "model.fused_projections":
        "tests/test_fused_projections.py::test_fused_model_runs_one_matmul_per_group_and_never_calls_the_projections",
    "model.loss_chunk_tokens":
        "tests/test_chunked_loss.py::test_the_models_loss_peak_memory_is_a_fraction_of_whole_logits",
    "model.parametrization": "tests/test_mup.py::test_coordinate_check",
    "model.mup_base_width": T_MUP_BASES,
    "model.mup_base_head_dim": T_MUP_BASES,
    "model.num_experts":
        "tests/test_moe.py::test_moe_model_parameters_and_init_follow_the_dense_rules",
    "model.experts_per_token": T_MOE_LAYER,
    "model.moe_aux_loss_coeff": T_MOE_LAYER,
    "model.moe_z_loss_coeff":
        "tests/test_bite_moe.py::test_the_z_loss_alone_reaches_the_router_gradient",
    "model.moe_capacity_factor":
        "tests/test_moe.py::test_capacity_factor_drops_and_counts_the_assignments_over_capacity",
    "model.moe_ffn_hidden_size": T_FAMILY_HF,
    "model.moe_layer_interval": T_FAMILY_HF,
    "model.moe_norm_topk_prob": ("tests/test_moe_grouped.py::"
                                 "test_fine_grained_experts_grouped_equal_the_loop_and_transformers_block"),
    **dict.fromkeys(["model.q_lora_rank", "model.kv_lora_rank", "model.qk_nope_head_dim",
                     "model.qk_rope_head_dim", "model.v_head_dim"], T_FAMILY_HF),
    **dict.fromkeys(["model.moe_router", "model.moe_groups", "model.moe_topk_groups",
                     "model.moe_routed_scaling_factor", "model.num_shared_experts",
                     "model.moe_first_dense_layers"], T_FAMILY_HF),
    "model.moe_bias_update_rate":
        "tests/test_families.py::test_deepseek_v3_expert_bias_is_saved_and_resumed",
    **dict.fromkeys(["model.mtp_depth", "model.mtp_loss_weight"],
                    "tests/test_mtp.py::test_mtp_loss_is_deepseek_v3s_formula_by_hand"),
    # parallel.*
    "parallel.tensor": "tests/test_tensor_parallel.py::test_model_tp2_matches_tp1",
    "parallel.pipeline": "tests/test_pipeline.py::test_pp2_matches_single_process",
    "parallel.context": "tests/test_context_parallel.py::test_model_context2_loss_and_grads_equal_one_process",
    "parallel.context_kind": "tests/test_context_allgather.py::test_train_allgather_matches_one_process",
    "parallel.expert": ("tests/test_expert_parallel.py::"
                        "test_expert2_and_expert2_with_zero3_equal_one_process_and_resume_on_expert1"),
    "parallel.expert_tensor": "tests/test_expert_parallel.py::test_topology_draws_the_expert_groups",
    # data.*
    "data.dataset": "tests/test_data_blend.py::test_test_split_through_the_config",
    "data.blend": "tests/test_data_blend.py::test_blend_valid_split_and_build_datasets",
    "data.tokenizer": "tests/test_checkpoint.py::test_checkpoint_of_another_tokenizer_is_refused",
    "data.valid_fraction": ("tests/test_bite_data.py::"
                            "test_the_configs_valid_fraction_sizes_the_validation_split"),
    "data.test_fraction": "tests/test_data_blend.py::test_test_split_through_the_config",
    "data.seed": "tests/test_bite_data.py::test_the_configs_seed_orders_the_split_and_its_samples",
    "data.exclude_samples": "tests/test_spikes.py::test_skip_drops_the_spiking_updates",
    # (the training test's reference goes through the same loader: a loader without ids passes)
    "data.document_mask": (
        "tests/test_bite_documents.py::"
        "test_the_loader_sends_each_samples_document_ids_computed_from_its_tokens"),
    # train.*
    "train.steps": "tests/test_train_zero.py::test_single_process_run_learns",
    "train.micro_batch_size": T_SHIPPED_DS,
    "train.global_batch_size": T_BF16_FP32_SUMS,
    "train.lr": "tests/test_mup.py::test_deepspeed_applies_each_groups_lr",
    "parallel.sequence_parallel": ("tests/test_tensor_parallel.py::"
                                   "test_sequence_parallel_setting_shards_the_activations_between_layers"),
    "logging.mlflow_experiment": ("tests/test_telemetry.py::"
                                  "test_the_mlflow_sink_logs_params_and_metrics_and_closes_the_run"),
    "train.hang_timeout_minutes": "tests/test_hang.py::test_rank_blocked_in_a_micro_batch_is_named",
    "parallel.pipeline_partition": ("tests/test_plan.py::"
                                    "test_pipeline_partition_setting_cuts_the_stages_the_run_builds"),
    "parallel.pipeline_schedule": ("tests/test_fsdp2_pipeline.py::"
                                   "test_each_schedule_trains_like_one_process"),
    "parallel.virtual_stages": ("tests/test_fsdp2_pipeline.py::"
                                "test_each_schedule_trains_like_one_process"),
    "train.loss_spike_factor": T_SPIKE_FACTOR, "logging.log_interval": T_SPIKE_FACTOR,
    "train.beta1": T_ADAM, "train.beta2": T_ADAM, "train.eps": T_ADAM,
    DS + "optimizer.params.betas": T_ADAM, DS + "optimizer.params.eps": T_ADAM,
    "train.min_lr": "tests/test_config.py::test_the_engines_schedule_follows_the_run_config",
    "train.warmup_steps": "tests/test_config.py::test_the_engines_schedule_follows_the_run_config",
    "train.lr_schedule": "tests/test_schedules.py::test_each_schedules_lr_at_every_step_is_its_formula",
    "train.decay_fraction": "tests/test_schedules.py::test_each_schedules_lr_at_every_step_is_its_formula",
    "train.decay_shape": "tests/test_schedules.py::test_each_schedules_lr_at_every_step_is_its_formula",
    "train.decay_start_step":
        "tests/test_schedules.py::test_annealed_checkpoint_equals_the_run_that_decayed_on_its_own",
    "train.weight_decay": "tests/test_mup.py::test_deepspeed_applies_each_groups_lr",
    "train.batch_ramp": ("tests/test_batch_ramp.py::"
                         "test_a_ramped_run_equals_its_batches_at_fixed_sizes_across_a_resume"),
    "train.optimizer": T_MUON_HAND, "train.muon_lr": T_MUON_HAND,
    "train.muon_weight_decay": T_MUON_HAND,
    DS + "zero_allow_untested_optimizer": "tests/test_muon.py::test_layout_equals_one_process",
    "train.muon_ns_dtype": "tests/test_muon.py::test_layout_equals_one_process",
    "train.grad_clip": T_BUILT_ENGINE,
    "train.precision": "tests/test_train_zero.py::test_bf16_zero0_first_update_is_adams_first_step",
    "train.fp8": "tests/test_fp8.py::test_an_emulated_fp8_run_ends_within_the_tolerance_of_fp32",
    "train.engine": "tests/test_fsdp2.py::test_dp2_trains_like_one_process_and_writes_the_same_final",
    "train.fsdp2_replicas": ("tests/test_fsdp2.py::"
                             "test_hsdp_trains_like_one_process_and_its_checkpoint_resumes_on_other_layouts"),
    "train.seed": "tests/test_model.py::test_same_seed_same_weights_different_seed_different",
    "train.eval_interval": ("tests/test_bite_eval.py::"
                            "test_the_validation_loss_is_due_every_interval_and_after_a_last_step_off_the_interval"),
    "train.eval_batches": "tests/test_bite_eval.py::test_the_validation_loss_reads_eval_batches_global_batches",
    "train.max_nonfinite_steps": "tests/test_faults.py::test_nonfinite_steps_in_a_row_stop_the_run",
    "train.on_loss_spike": "tests/test_spikes.py::test_skip_drops_the_spiking_updates",
    "train.straggler_interval":
        "tests/test_stragglers.py::test_a_rank_with_slow_measured_times_is_named_an_even_run_names_nobody",
    "train.straggler_margin":
        "tests/test_stragglers.py::test_a_rank_with_slow_measured_times_is_named_an_even_run_names_nobody",
    "train.straggler_patience":
        "tests/test_stragglers.py::test_a_rank_with_slow_measured_times_is_named_an_even_run_names_nobody",
    "train.collective_timeout_minutes": T_TIMEOUTS,
    "train.io_timeout_minutes": T_TIMEOUTS,
    "train.exit_after_minutes": "tests/test_faults.py::test_exit_after_minutes_saves_and_exits_75",
    # checkpoint.*
    "checkpoint.save_interval": "tests/test_checkpoint.py::test_resume_gives_bitwise_the_same_losses",
    "checkpoint.save_interval_minutes": "tests/test_faults.py::test_run_control_owns_both_save_cadences",
    "checkpoint.keep_last": "tests/test_checkpoint.py::test_keep_last_and_keep_every",
    "checkpoint.keep_every": "tests/test_checkpoint.py::test_keep_last_and_keep_every",
    "checkpoint.save_final": "tests/test_checkpoint.py::test_run_ends_with_a_checkpoint_of_its_last_step_without_save_final",
    # (tests/test_save_memory.py builds its Saver itself: the setting never reaches it)
    "checkpoint.async_save": ("tests/test_async_save.py::"
                              "test_background_saves_resume_bitwise_like_synchronous_ones"),
    # logging.*
    "logging.report_to": ("tests/test_telemetry.py::"
                          "test_the_mlflow_sink_logs_params_and_metrics_and_closes_the_run"),
    "logging.level": "tests/test_telemetry.py::test_log_level_warning_keeps_step_and_eval_lines_only",
    "logging.mlflow_tracking_uri": ("tests/test_telemetry.py::"
                                    "test_the_mlflow_sink_reports_to_the_tracking_uri_it_is_given"),
    "logging.wandb_mode": "tests/test_telemetry.py::test_the_wandb_sink_opens_in_the_configured_mode",
    "logging.wandb_project": ("tests/test_bite_telemetry.py::"
                              "test_the_wandb_run_opens_in_the_configured_project_and_mode"),
    "logging.progress_bar": "tests/test_telemetry.py::test_the_progress_bar_is_drawn_only_on_a_terminal",
    # the test model turns both off/sets one: ignored, the run draws curves.png / measures a peak
    "logging.curves": "tests/test_telemetry.py::test_training_reports_to_mlflow_and_draws_curves",
    "logging.peak_tflops": "tests/test_train_zero.py::test_single_process_run_learns",
    "logging.profile_steps": "tests/test_telemetry.py::test_training_records_hardware_flops_and_writes_a_profile_trace",
    "logging.memory_snapshot":
        "tests/test_memory_snapshot.py::test_a_cpu_run_says_its_snapshot_setting_is_a_no_op",
    # eval.*: the in-run scores after steps 2 and 4 are HFLM's on the same examples
    "eval.tasks": T_EVAL,
    "eval.interval": T_EVAL,
    "eval.limit": T_EVAL,
    # DeepSpeed keys (shipped JSONs and the resolver)
    DS + "train_batch_size": T_BF16_FP32_SUMS,
    DS + "train_micro_batch_size_per_gpu": T_SHIPPED_DS,
    DS + "gradient_accumulation_steps": T_BF16_FP32_SUMS,
    DS + "gradient_clipping": T_BUILT_ENGINE,
    DS + "optimizer.type": T_ZERO_FP32,
    DS + "optimizer.params.lr": "tests/test_mup.py::test_deepspeed_applies_each_groups_lr",
    DS + "optimizer.params.weight_decay": "tests/test_mup.py::test_deepspeed_applies_each_groups_lr",
    DS + "optimizer.params.torch_adam": "tests/test_train_zero.py::test_cpu_offload_matches_zero3",
    DS + "bf16.enabled": "tests/test_train_zero.py::test_bf16_zero0_first_update_is_adams_first_step",
    DS + "bf16.immediate_grad_update":
        "tests/test_plan.py::test_the_resolver_adds_bf16_gradients_in_their_backward_hooks",
    DS + "data_types.grad_accum_dtype": T_BF16_FP32_SUMS,
    DS + "communication_data_type": T_BF16_FP32_SUMS,
    DS + "zero_optimization.stage": "tests/test_memory_scaling.py::test_zero3_construction_adds_a_partition_per_rank",
    DS + "zero_optimization.offload_optimizer.device": "tests/test_train_zero.py::test_cpu_offload_matches_zero3",
    DS + "zero_optimization.offload_param.device": "tests/test_train_zero.py::test_nvme_offload_matches_zero3",
    DS + "zero_optimization.offload_optimizer.nvme_path":
        "tests/test_nvme_swap.py::test_auto_swaps_to_the_jobs_node_local_scratch_not_the_run_dir",
    DS + "zero_optimization.offload_param.nvme_path":
        "tests/test_nvme_swap.py::test_auto_swaps_to_the_jobs_node_local_scratch_not_the_run_dir",
    DS + "pipeline.pipe_partitioned": "tests/test_pipeline.py::test_tp2_pp2_sequence_parallel_matches_single_process",
    DS + "pipeline.grad_partitioned": "tests/test_pipeline.py::test_tp2_pp2_sequence_parallel_matches_single_process",
    DS + "checkpoint.load_universal": "tests/test_checkpoint.py::test_universal_checkpoint_reshards_dp2_to_dp1",
    "data.num_workers": "tests/test_data_workers.py::test_the_runs_samples_are_read_in_num_workers_processes",
    DS + "optimizer.params.fused":
        "tests/test_ds_knobs.py::test_the_optimizer_runs_torchs_fused_adamw_kernel_exactly_on_cuda",
    DS + "steps_per_print": T_LOGGED,
    DS + "wall_clock_breakdown": "tests/test_ds_knobs.py::test_wall_clock_breakdown_prints_deepspeeds_timers",
    DS + "zero_optimization.overlap_comm": T_ZERO2_BUFFERS,
    DS + "zero_optimization.contiguous_gradients": T_ZERO2_BUFFERS,
    DS + "zero_optimization.reduce_bucket_size":
        "tests/test_ds_knobs.py::test_zero2_reduces_in_buckets_of_the_configured_size",
    DS + "zero_optimization.allgather_bucket_size":
        "tests/test_ds_knobs.py::test_zero2_optimizer_is_built_with_the_configured_allgather_bucket",
    DS + "zero_optimization.stage3_prefetch_bucket_size":
        "tests/test_ds_knobs.py::test_zero3_prefetches_in_buckets_the_resolver_sizes_from_the_model",
    DS + "zero_optimization.stage3_param_persistence_threshold":
        "tests/test_ds_knobs.py::test_zero3_keeps_parameters_under_the_persistence_threshold_gathered",
    DS + "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "tests/test_ds_knobs.py::test_zero3_16bit_save_follows_gather_16bit_weights_on_model_save",
    DS + "zero_optimization.offload_optimizer.buffer_count": T_NVME,
    DS + "zero_optimization.offload_param.buffer_count": T_NVME,
    DS + "zero_optimization.offload_optimizer.pin_memory": T_PINNED,
    DS + "zero_optimization.offload_param.pin_memory": T_PINNED,
    DS + "zero_optimization.offload_param.buffer_size": T_NVME,
    DS + "zero_optimization.offload_param.max_in_cpu": T_NVME,
    DS + "aio.block_size": T_NVME,
    DS + "aio.queue_depth": T_NVME,
    DS + "aio.intra_op_parallelism": T_NVME,
    DS + "aio.single_submit": T_NVME,
    DS + "aio.overlap_events": T_NVME,
}

# The mutant (bench/mutants/*.yaml) that breaks each setting's line, and whose tests include the
# test REGISTRY cites: proof that the cited test fails when the setting is ignored
# (`python bench/mutants.py --id ID` runs it). A cited test no mutant names is not proven.
_DS_ONLY = "read by DeepSpeed only: no line of this repository to break"


def _survived(mutant: str) -> str:
    return f"its mutant {mutant} survived the cited test (bench/mutants.py): a gap to close"


MUTANT_OF: dict[str, str] = {
    "train.steps": "train-steps-bound-one-short",
    "data.tokenizer": "checkpoint-tokenizer-unchecked",
    "train.eval_interval": "train-eval-interval-ignored",
    "train.eval_batches": "train-eval-batches-ignored",
    DS + "zero_optimization.stage3_prefetch_bucket_size": "train-zero3-prefetch-bucket-unsized",
    "train.collective_timeout_minutes": "train-collective-timeout-ignored",
    "logging.report_to": "telemetry-report-to-ignored",
    "logging.mlflow_tracking_uri": "telemetry-mlflow-uri-ignored",
    "logging.curves": "telemetry-curves-never-drawn",
    "logging.peak_tflops": "telemetry-peak-tflops-ignored",
    "train.micro_batch_size": "train-micro-batch-ignored",
    DS + "train_micro_batch_size_per_gpu": "train-micro-batch-ignored",
    "train.optimizer": "muon-optimizer-ignored",
    "train.muon_lr": "muon-lr-is-adamws",
    "train.muon_weight_decay": "muon-weight-decay-is-adamws",
    "train.muon_ns_dtype": "muon-ns-dtype-ignored",
    DS + "zero_allow_untested_optimizer": "muon-zero-untested-optimizer-refused",
    "train.lr_schedule": "schedules-linear-floor",
    "train.decay_fraction": "schedules-wsd-default-decay-start",
    "train.decay_shape": "schedules-decay-shape-sqrt",
    "train.decay_start_step": "schedules-anneal-resume-lr",
    "train.batch_ramp": "ramp-engine-accumulation-unchanged",
    "run_dir": "checkpoint-save-interval-ignored",
    "checkpoint.save_interval": "checkpoint-save-interval-ignored",
    **dict.fromkeys(["model.preset", "model.vocab_size", "model.hidden_size", "model.num_layers",
                     "model.num_heads", "model.num_kv_heads", "model.ffn_hidden_size",
                     "model.tie_embeddings"], "model-mlp-activation"),
    "model.seq_length": "data-sample-without-its-last-label",
    "model.rope_theta": "model-rope-theta-ignored",
    "model.family": "seam-family-attention-ignored",
    "model.head_dim": "seam-head-dim-ignored",
    "model.rope_scaling": "seam-llama3-rope-ignored",
    "model.rope_scaling_factor": "seam-rope-factor-ignored",
    "model.rope_low_freq_factor": "seam-rope-low-freq-factor-ignored",
    "model.rope_high_freq_factor": "seam-rope-high-freq-factor-ignored",
    "model.rope_original_max_positions": "seam-rope-original-positions-ignored",
    "model.norm_eps": "model-norm-eps-ignored",
    "model.init_std": "model-init-std-ignored",
    "model.activation_checkpointing": "model-recompute-off",
    "model.activation_checkpointing_interval": "model-recompute-interval-ignored",
    "model.vocab_pad_multiple": "model-vocab-pad-multiple-ignored",
    "model.init_from": "model-init-from-ignored",
    "model.fused_projections": "model-fused-qkv-never",
    "model.loss_chunk_tokens": "model-loss-never-chunked",
    "model.parametrization": "mup-hidden-lr-not-divided",
    "model.mup_base_width": "mup-base-width-ignored",
    "model.mup_base_head_dim": "mup-base-head-dim-ignored",
    "model.num_experts": "model-num-experts-ignored",
    "model.experts_per_token": "moe-top-k-ignored",
    "model.moe_aux_loss_coeff": "moe-aux-coeff-ignored",
    "model.moe_z_loss_coeff": "moe-z-coeff-fixed",
    "model.moe_capacity_factor": "moe-capacity-factor-ignored",
    "model.moe_ffn_hidden_size": "qwen3moe-expert-size-is-dense",
    "model.moe_layer_interval": "qwen3moe-interval-ignored",
    "model.moe_norm_topk_prob": "qwen3moe-topk-always-renormalised",
    "model.q_lora_rank": "mla-q-lora-rank-ignored",
    "model.kv_lora_rank": "mla-kv-lora-rank-ignored",
    "model.qk_nope_head_dim": "mla-qk-nope-head-dim-ignored",
    "model.qk_rope_head_dim": "mla-qk-rope-head-dim-ignored",
    "model.v_head_dim": "mla-v-head-dim-ignored",
    "model.moe_router": "dsmoe-router-always-softmax",
    "model.moe_groups": "dsmoe-groups-ignored",
    "model.moe_topk_groups": "dsmoe-topk-groups-ignored",
    "model.moe_routed_scaling_factor": "dsmoe-scaling-ignored",
    "model.num_shared_experts": "dsmoe-shared-width-ignored",
    "model.moe_first_dense_layers": "dsmoe-first-dense-layers-ignored",
    "model.moe_bias_update_rate": "dsmoe-bias-not-updated",
    "model.mtp_depth": "mtp-every-module-predicts-the-next-token",
    "model.mtp_loss_weight": "mtp-loss-weight-ignored",
    "parallel.tensor": "model-tp-forward-not-reduced",
    "parallel.context": "context-chunk-positions-from-zero",
    "parallel.context_kind": "context-allgather-kind-ignored",
    "parallel.expert": "ep-experts-counted-on-every-rank-in-the-norm",
    "parallel.expert_tensor": "ep-expert-tensor-ignored",
    "parallel.sequence_parallel": "model-sequence-parallel-setting-ignored",
    "parallel.pipeline_partition": "model-pipeline-partition-ignored",
    "parallel.pipeline_schedule": "pipes-schedule-ignored",
    "parallel.virtual_stages": "pipes-virtual-stages-ignored",
    "data.dataset": "data-dataset-split-ignored",
    "data.blend": "data-blend-first-component-only",
    "data.valid_fraction": "data-valid-fraction-halved",
    "data.test_fraction": "data-test-fraction-ignored",
    "data.seed": "data-seed-ignored",
    "data.exclude_samples": "train-exclude-samples-ignored",
    "data.document_mask": "data-document-ids-not-sent",
    "data.num_workers": "data-num-workers-ignored",
    **dict.fromkeys(["train.global_batch_size", DS + "train_batch_size",
                     DS + "gradient_accumulation_steps", DS + "data_types.grad_accum_dtype",
                     DS + "communication_data_type"], "train-gradients-summed-in-bf16"),
    **dict.fromkeys(["train.lr", "train.weight_decay", DS + "optimizer.params.lr",
                     DS + "optimizer.params.weight_decay"], "train-lr-not-in-the-groups"),
    "logging.mlflow_experiment": "telemetry-mlflow-experiment-ignored",
    "train.hang_timeout_minutes": "train-hang-timeout-ignored",
    "train.loss_spike_factor": "faults-spike-factor-ignored",
    "logging.log_interval": "telemetry-log-interval-ignored",
    **dict.fromkeys(["train.beta1", "train.beta2", "train.eps", DS + "optimizer.params.betas",
                     DS + "optimizer.params.eps"], "train-betas-ignored"),
    "train.min_lr": "train-min-lr-ignored",
    "train.warmup_steps": "train-warmup-ignored",
    "train.grad_clip": "train-grad-clip-ignored",
    DS + "gradient_clipping": "train-grad-clip-ignored",
    "train.precision": "train-bf16-not-enabled",
    "train.fp8": "fp8-run-not-converted",
    DS + "bf16.enabled": "train-bf16-not-enabled",
    DS + "bf16.immediate_grad_update": "planner-immediate-grad-update-off",
    "train.engine": "fsdp2-clip-never",
    "train.fsdp2_replicas": "fsdp2-hsdp-norm-summed-over-replicas",
    "train.seed": "model-seed-ignored",
    "train.max_nonfinite_steps": "faults-nonfinite-limit-off-by-one",
    "train.on_loss_spike": "train-exclude-samples-ignored",
    **dict.fromkeys(["train.straggler_interval", "train.straggler_margin",
                     "train.straggler_patience"], "train-straggler-interval-ignored"),
    "train.io_timeout_minutes": "train-io-timeout-is-the-collective-one",
    "train.exit_after_minutes": "faults-exit-after-minutes-ignored",
    "checkpoint.save_interval_minutes": "faults-save-minutes-ignored",
    "checkpoint.keep_last": "checkpoint-keep-every-ignored",
    "checkpoint.keep_every": "checkpoint-keep-every-ignored",
    "checkpoint.save_final": "checkpoint-last-step-not-saved",
    "checkpoint.async_save": "checkpoint-async-save-ignored",
    "logging.level": "telemetry-level-ignored",
    "logging.wandb_mode": "telemetry-wandb-mode-ignored",
    "logging.wandb_project": "telemetry-wandb-project-ignored",
    "logging.progress_bar": "telemetry-progress-bar-on-pipes",
    "logging.profile_steps": "telemetry-profile-steps-ignored",
    "logging.memory_snapshot": "snapshot-not-wired",
    **dict.fromkeys(["eval.tasks", "eval.interval", "eval.limit"], "eval-tasks-interval-ignored"),
    DS + "zero_optimization.offload_optimizer.nvme_path": "data-nvme-auto-in-the-run-dir",
    DS + "zero_optimization.offload_param.nvme_path": "data-nvme-auto-in-the-run-dir",
    DS + "checkpoint.load_universal": "checkpoint-load-universal-not-set",
    DS + "zero_optimization.stage3_param_persistence_threshold":
        "train-zero3-persistence-threshold-zero",
}

# Settings whose cited test no mutant proves yet, each with why. Only ever remove entries.
UNMUTATED: dict[str, str] = {
    "deepspeed": "the JSON's path: its keys have their own entries",
    "model.compile": "a mutant would have to break inductor's cache reuse; not written yet",
    "parallel.pipeline": "DeepSpeed's PipelineModule does the split; no mutant written yet",
    DS + "optimizer.type": _DS_ONLY,
    DS + "optimizer.params.torch_adam": "no mutant written yet (the resolver's offload rule)",
    DS + "optimizer.params.fused": "the cited test runs on CUDA only",
    DS + "zero_optimization.stage": _DS_ONLY,
    DS + "zero_optimization.offload_optimizer.device": _DS_ONLY,
    DS + "zero_optimization.offload_param.device": _DS_ONLY,
    DS + "pipeline.pipe_partitioned": "no mutant written yet (the resolver's pipeline default)",
    DS + "pipeline.grad_partitioned": "no mutant written yet (the resolver's pipeline default)",
    DS + "steps_per_print": _DS_ONLY,
    DS + "wall_clock_breakdown": _DS_ONLY,
    DS + "zero_optimization.overlap_comm": _DS_ONLY,
    DS + "zero_optimization.contiguous_gradients": _DS_ONLY,
    DS + "zero_optimization.reduce_bucket_size": _DS_ONLY + " (the resolver sizes it at ZeRO-3 only)",
    DS + "zero_optimization.allgather_bucket_size": _DS_ONLY,
    DS + "zero_optimization.stage3_gather_16bit_weights_on_model_save": _DS_ONLY,
    DS + "zero_optimization.offload_optimizer.buffer_count": _DS_ONLY,
    DS + "zero_optimization.offload_param.buffer_count": _DS_ONLY,
    DS + "zero_optimization.offload_optimizer.pin_memory": _DS_ONLY,
    DS + "zero_optimization.offload_param.pin_memory": _DS_ONLY,
    DS + "zero_optimization.offload_param.buffer_size": _DS_ONLY,
    DS + "zero_optimization.offload_param.max_in_cpu": _DS_ONLY,
    DS + "aio.block_size": _DS_ONLY,
    DS + "aio.queue_depth": _DS_ONLY,
    DS + "aio.intra_op_parallelism": _DS_ONLY,
    DS + "aio.single_submit": _DS_ONLY,
    DS + "aio.overlap_events": _DS_ONLY,
}
# UNMUTATED as written (DeepSpeed keys without the prefix): it may only shrink.
FROZEN_UNMUTATED = frozenset([
    "train_micro_batch_size_per_gpu", "zero_optimization.stage3_prefetch_bucket_size", "logging.report_to",
    "logging.mlflow_tracking_uri", "logging.curves", "logging.peak_tflops",
    "train.micro_batch_size", "train.eval_interval", "train.eval_batches",
    "aio.block_size", "aio.intra_op_parallelism", "aio.overlap_events", "aio.queue_depth",
    "aio.single_submit", "data.tokenizer", "deepspeed", "model.compile",
    "optimizer.params.fused", "optimizer.params.torch_adam", "optimizer.type",
    "parallel.pipeline", "pipeline.grad_partitioned", "pipeline.pipe_partitioned",
    "steps_per_print", "train.collective_timeout_minutes", "train.steps",
    "wall_clock_breakdown", "zero_optimization.allgather_bucket_size",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_param.pin_memory",
    "zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
])


# Settings without a biting test yet, each with why. Only ever remove entries.
_FP16_SCALER = "fp16 loss scaler knob: no fp16 training test (see fp16.enabled)"
GAPS: dict[str, str] = {
    DS + "fp16.enabled": ("no fp16 training test: DeepSpeed refuses fp16 on a CPU without "
                          "oneDNN fp16 (AVX2 machines like CI's)"),
    DS + "fp16.loss_scale": _FP16_SCALER,
    DS + "fp16.initial_scale_power": _FP16_SCALER,
    DS + "fp16.loss_scale_window": _FP16_SCALER,
    DS + "fp16.hysteresis": _FP16_SCALER,
    DS + "fp16.min_loss_scale": _FP16_SCALER,
}

# GAPS as written when the registry was made (DeepSpeed keys without the prefix): GAPS must stay
# a subset, so it can only shrink. Remove a name here when its gap closes; never add one.
FROZEN_GAPS = frozenset([
    "fp16.enabled", "fp16.hysteresis", "fp16.initial_scale_power", "fp16.loss_scale",
    "fp16.loss_scale_window", "fp16.min_loss_scale", "logging.peak_tflops",
])

# Keys the resolver adds beyond the shipped JSONs (pretrain/resolve/ds_config.py, pretrain/resolve/run.py).
RESOLVER_KEYS = ("optimizer.params.fused", "pipeline.pipe_partitioned", "bf16.immediate_grad_update",
                 "pipeline.grad_partitioned", "checkpoint.load_universal",
                 "zero_allow_untested_optimizer")


def config_fields(cls=run_config.RunConfig, prefix: str = "") -> set[str]:
    """Every leaf field of the run config, as "section.field" (sections are dataclasses)."""
    found = set()
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            found |= config_fields(factory, f"{prefix}{f.name}.")
        else:
            found.add(prefix + f.name)
    return found


def json_leaf_paths(node, prefix: str = "") -> set[str]:
    if isinstance(node, dict):
        return set().union(*(json_leaf_paths(v, f"{prefix}{k}.") for k, v in node.items()))
    return {prefix.rstrip(".")}


def deepspeed_keys() -> set[str]:
    found = set(RESOLVER_KEYS)
    for path in (ROOT / "ds_configs").glob("*.json"):
        found |= json_leaf_paths(json.loads(path.read_text()))
    return {DS + key for key in found}


def resolver_literal_keys() -> set[str]:
    """String keys the resolver writes: `x["key"] = ...`, `setdefault("key")`, `_fill(_, "key")`."""
    keys = set()
    for name in ("pretrain/resolve/ds_config.py", "pretrain/resolve/run.py"):
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Assign):
                keys |= {t.slice.value for t in node.targets if isinstance(t, ast.Subscript)
                         and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)}
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                func = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                at = {"setdefault": 0, "_fill": 1}.get(func)
                if at is not None and len(node.args) > at and isinstance(node.args[at], ast.Constant):
                    keys.add(node.args[at].value)
    return keys


def every_setting() -> set[str]:
    return config_fields() | deepspeed_keys()


def test_every_setting_has_a_biting_test_or_a_reasoned_gap():
    settings = every_setting()
    missing = sorted(settings - set(REGISTRY) - set(GAPS))
    assert not missing, (f"settings without a test in REGISTRY ({__file__}): {missing}; name the "
                         "test that fails when the setting is ignored")
    assert not set(REGISTRY) & set(GAPS), sorted(set(REGISTRY) & set(GAPS))
    stale = sorted((set(REGISTRY) | set(GAPS)) - settings)
    assert not stale, f"entries for settings that no longer exist: {stale}"


def test_gaps_only_shrink_and_each_has_a_reason():
    gaps = {key.removeprefix(DS) for key in GAPS}
    assert gaps <= FROZEN_GAPS, f"a new setting cannot be a gap: {sorted(gaps - FROZEN_GAPS)}"
    assert all(reason.strip() for reason in GAPS.values())


def test_every_named_test_function_exists():
    functions: dict[str, set[str]] = {}
    absent = []
    for setting, target in sorted(REGISTRY.items()):
        file, _, function = target.partition("::")
        if file not in functions:
            path = ROOT / file
            tree = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[])
            functions[file] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if function not in functions[file]:
            absent.append(f"{setting}: {target}")
    assert not absent, f"registry entries naming no test function: {absent}"


def test_every_key_the_resolver_writes_is_a_registered_setting():
    names = {part for key in every_setting() for part in key.removeprefix(DS).split(".")}
    unseen = sorted(resolver_literal_keys() - names)
    assert not unseen, (f"pretrain/resolve/ds_config.py or pretrain/resolve/run.py writes DeepSpeed keys {unseen} "
                        "that are not in RESOLVER_KEYS")


def _mutants():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants_tool", ROOT / "bench" / "mutants.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutants_tool", tool)  # its dataclasses look their module up
    spec.loader.exec_module(tool)
    return {m.id: m for m in tool.load_mutants()}


def test_every_cited_test_is_proven_by_a_mutant_it_catches():
    """Each registered setting names a mutant whose tests include the test REGISTRY cites (the
    mutant runs show it caught), or sits in UNMUTATED with its reason."""
    mutants = _mutants()
    unknown = sorted(f"{s}: {m}" for s, m in MUTANT_OF.items() if m not in mutants)
    assert not unknown, f"MUTANT_OF names mutants that bench/mutants/*.yaml does not hold: {unknown}"
    wrong = sorted(f"{s}: {MUTANT_OF[s]} does not run {REGISTRY[s]}" for s in MUTANT_OF
                   if s in REGISTRY and REGISTRY[s] not in mutants[MUTANT_OF[s]].tests)
    assert not wrong, wrong
    unproven = sorted(set(REGISTRY) - set(MUTANT_OF) - set(UNMUTATED))
    assert not unproven, f"settings whose cited test no mutant proves: {unproven}"
    assert not set(MUTANT_OF) & set(UNMUTATED), sorted(set(MUTANT_OF) & set(UNMUTATED))
    assert set(MUTANT_OF) | set(UNMUTATED) <= set(REGISTRY), \
        sorted((set(MUTANT_OF) | set(UNMUTATED)) - set(REGISTRY))
    assert {s.removeprefix(DS) for s in UNMUTATED} <= FROZEN_UNMUTATED, "UNMUTATED may only shrink"
    assert all(reason.strip() for reason in UNMUTATED.values())
