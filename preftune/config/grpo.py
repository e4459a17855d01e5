"""The GRPO section's keys (`grpo.*`), declared as `schema.py` declares the others (it re-exports
`GRPOConfig`): sampling, rollouts and tools, rewards, advantages, the loss, the rollout engine."""
from __future__ import annotations

from dataclasses import dataclass

from preftune.config.fields import FIXED, FREE, knob
from preftune.losses.names import (ADVANTAGE_ESTIMATORS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES,
                                   SCALE_REWARDS, TOOL_CALL_FORMATS, VLLM_IS_MODES, VLLM_MODES)


@dataclass
class GRPOConfig:
    """GRPO and its family: sampling, rewards, advantages and the loss."""

    rollout: str = knob(
        "online",
        "online (sample from the policy) or offline (the traces' responses form the groups)",
        choices=("online", "offline"), resume=FIXED)
    prompts_per_step: int = knob(
        16,
        "prompts per generation batch (one optimiser step)",
        range="[1, inf)",
        peer="TRL generation_batch_size / num_generations; NeMo-RL grpo.num_prompts_per_step",
        resume=FIXED,
    )
    num_generations: int = knob(
        8, "G: completions per prompt", range="[1, inf)",
        peer="TRL num_generations; NeMo-RL grpo.num_generations_per_prompt", resume=FIXED)
    micro_batch_size: int = knob(
        64, "completions per forward/backward; gradients accumulate exactly", range="[1, inf)",
        peer="\u2248 TRL per_device_train_batch_size (per process); NeMo-RL "
             "policy.train_micro_batch_size")
    max_completion_length: int = knob(
        256, "new tokens per completion", range="[1, inf)",
        peer="TRL max_completion_length; NeMo-RL policy.generation.max_new_tokens")
    temperature: float = knob(
        1.0, "sampling temperature (log-probs use the same)", range="(0, inf)",
        peer="TRL temperature")
    top_p: float = knob(1.0, "nucleus sampling", range="(0, 1]", peer="TRL top_p")
    top_k: int = knob(0, "top-k sampling (0 = off)", range="[0, inf)", peer="TRL top_k")
    reward_funcs: list[str] = knob(
        help="built-in names, module:fn, file.py:fn or a "
             "sequence-classification model folder (a reward model)",
        peer="TRL reward_funcs", factory=lambda: ["accuracy"])
    reward_model_batch_size: int = knob(
        64,
        "completions per forward of a reward model (a "
        "sequence-classification folder in reward_funcs)",
        range="[1, inf)")
    reward_weights: list[float] | None = knob(
        None, "one weight per function (null = all 1)", range="(-inf, inf)",
        peer="TRL reward_weights")
    overlong_buffer_len: int = knob(
        0, "L_cache of soft_overlong", range="[0, inf)",
        peer="TRL soft_punish_cache; verl overlong_buffer.len")
    advantage_estimator: str = knob(
        "grpo", "the advantage's baseline: grpo (group mean), rloo (leave-one-out mean), "
        "reinforce_plus_plus_baseline (group mean, then batch whitening)",
        choices=ADVANTAGE_ESTIMATORS,
        peer="verl algorithm.adv_estimator; TRL RLOOTrainer; NeMo-RL use_leave_one_out_baseline")
    scale_rewards: str = knob(
        "group",
        "std the grpo estimator's advantage is divided by: group, batch, none",
        choices=SCALE_REWARDS,
        peer="TRL scale_rewards; NeMo-RL normalize_rewards; verl norm_adv_by_std_in_grpo",
    )
    loss_type: str = knob(
        "dapo", "the loss: surrogate and aggregation (docs/algorithms.md)",
        choices=LOSS_TYPES, peer="TRL loss_type")
    beta: float = knob(
        0.0, "KL coefficient (k3); > 0 loads a reference model", range="[0, inf)",
        peer="TRL beta; kl_coeff; NeMo-RL loss_fn.reference_policy_kl_penalty")
    epsilon: float = knob(
        0.2, "lower clip (and upper unless epsilon_high)", range="[0, 1)",
        peer="TRL epsilon; cliprange; NeMo-RL loss_fn.ratio_clip_min")
    epsilon_high: float | None = knob(
        None, "upper clip (DAPO clip-higher, e.g. 0.28)", range="[0, inf)",
        peer="TRL epsilon_high; NeMo-RL loss_fn.ratio_clip_max")
    delta: float | None = knob(None, "two-sided clip: cap on the unclipped ratio",
                               range="(1, inf)", peer="TRL delta")
    vespo_k_pos: float = knob(2.0, "vespo: power k of the weight for A >= 0", range="[0, inf)",
                              peer="TRL vespo_k_pos")
    vespo_lambda_pos: float = knob(
        3.0, "vespo: decay lambda of the weight for A >= 0", range="[0, inf)",
        peer="TRL vespo_lambda_pos")
    vespo_k_neg: float = knob(3.0, "vespo: power k of the weight for A < 0", range="[0, inf)",
                              peer="TRL vespo_k_neg")
    vespo_lambda_neg: float = knob(
        2.0, "vespo: decay lambda of the weight for A < 0", range="[0, inf)",
        peer="TRL vespo_lambda_neg")
    use_bias_correction_kl: bool = knob(
        False, "multiply k3 by the importance ratio (false: plain k3; TRL 1.16 defaults to true)",
        peer="TRL use_bias_correction_kl")
    importance_sampling_level: str = knob(
        "token", "token or sequence (GSPO)", choices=IMPORTANCE_SAMPLING_LEVELS,
        peer="TRL importance_sampling_level")
    num_iterations: int = knob(
        1, "optimiser steps per generation batch (\u03bc)", range="[1, inf)",
        peer="TRL num_iterations; verl ppo_epochs", resume=FIXED)
    mask_truncated_completions: bool = knob(
        False, "exclude completions without EOS from the loss",
        peer="TRL mask_truncated_completions")
    routing_replay: bool = knob(
        False, "mixture of experts: the training and reference passes run the experts the "
        "sampler chose for each token (R3); the routers still learn (docs/algorithms.md)",
        peer="verl/NeMo-RL routing replay (R3)")
    dynamic_sampling: bool = knob(
        False, "DAPO: drop zero-spread groups and resample",
        peer="verl algorithm.filter_groups.enable")
    max_resample_rounds: int = knob(
        4, "extra sampling rounds per step for dynamic sampling", range="[0, inf)",
        peer="verl filter_groups.max_num_gen_batches")
    use_vllm: bool = knob(
        False,
        "sample with vLLM (docs/vllm.md); weights are pushed to it after every update",
        peer="TRL use_vllm",
    )
    vllm_mode: str = knob(
        "colocate", "colocate: one engine inside each training process",
        choices=VLLM_MODES, peer="TRL vllm_mode")
    vllm_gpu_memory_utilization: float = knob(
        0.3,
        "share of GPU memory the engine takes (weights + KV cache); training has the rest",
        range="(0, 1]",
        peer="TRL vllm_gpu_memory_utilization",
    )
    vllm_tensor_parallel_size: int = knob(
        1, "ranks per engine: consecutive ranks run one engine together (1 = an engine per rank)",
        range="[1, inf)", peer="TRL vllm_tensor_parallel_size")
    vllm_enable_sleep_mode: bool = knob(
        False, "GPU: release the engine's memory during the training passes (no-op on CPU)",
        peer="TRL vllm_enable_sleep_mode", resume=FREE)
    vllm_kv_cache_gib: int = knob(
        1, "CPU: the engine's KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE)", range="[1, inf)")
    vllm_importance_sampling_correction: bool = knob(
        True, "reweight the loss by trainer / engine probabilities of the sampled tokens",
        peer="TRL vllm_importance_sampling_correction")
    vllm_importance_sampling_mode: str = knob(
        "sequence_mask",
        "token_ or sequence_ ratio; _truncate clips it, _mask zeroes it outside the bounds",
        choices=VLLM_IS_MODES, peer="TRL vllm_importance_sampling_mode")
    vllm_importance_sampling_clip_max: float | None = knob(
        3.0, "upper bound C_max of the ratio (null = none)", range="(0, inf)",
        peer="TRL vllm_importance_sampling_clip_max (vllm_importance_sampling_cap)")
    vllm_importance_sampling_clip_min: float | None = knob(
        None, "lower bound C_min of the ratio (null = none)", range="[0, inf)",
        peer="TRL vllm_importance_sampling_clip_min")
    tools: list[str] = knob(
        help="functions the policy may call (module:fn, file.py:fn); each needs type hints and a "
        "Google-style docstring (docs/agents.md)", peer="TRL tools", factory=list)
    environment_factory: str | dict[str, str] | None = knob(
        None,
        "a class (module:Class, file.py:Class): one instance per rollout, reset(**row); its public "
        "methods are tools, its get_reward() a reward. Or a mapping of names to classes: each row "
        "picks one by its `environment` column", peer="TRL environment_factory")
    rollout_func: str | None = knob(
        None,
        "a function (module:fn, file.py:fn) that samples the "
        "completions itself: rollout_func(prompts, trainer) -> "
        "prompt_ids, completion_ids, logprobs, env_mask (docs/agents.md)", peer="TRL rollout_func")
    max_tool_calling_iterations: int | None = knob(
        None,
        "tool rounds per completion (null = until the completion budget is spent)",
        range="[0, inf)",
        peer="TRL max_tool_calling_iterations",
    )
    max_tool_response_length: int | None = knob(
        None,
        "tokens of one tool result shown to the policy (the rest is cut; null = all)",
        range="[1, inf)",
    )
    tool_timeout_seconds: float = knob(
        30.0,
        "one tool call's limit; past it the policy reads an error as the result", range="(0, inf)")
    tool_call_format: str = knob(
        "auto",
        "how calls are written: auto (from the chat template), hermes (<tool_call> JSON), llama3 "
        "(JSON), glm4 (<arg_key>/<arg_value>)", choices=TOOL_CALL_FORMATS)
    log_trajectories: int = knob(
        0,
        "tool runs: trajectories per generation batch "
        "written to OUTPUT_DIR/trajectories.jsonl (0 = none)",
        range="[0, inf)", resume=FREE)
