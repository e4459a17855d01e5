"""Every config key, declared once: type, default, choices, range, help, the peer name and what a
change means on a resume (`fields.knob`).

One dataclass per component; `Config` holds them. The dataclass defaults are the only defaults.
On resume (`fields.on_resume`): a key says `resume=FREE` or `resume=FIXED`, else its section does
(`section(..., resume=...)`), else it is TRAJECTORY. FREE keys change no training step; FIXED keys
give the checkpoint its meaning (the model, the data and its order, the batch shape, the seed).
"""
from __future__ import annotations

from dataclasses import dataclass

from preftune.config.fields import FIXED, FREE, internal, knob, section
from preftune.config.grpo import GRPOConfig
from preftune.losses.names import (DPO_LOSS_TYPES, KTO_LOSS_TYPES)

# log.report_to's names -> (module that must be importable, pip extra that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the policy."""

    enabled: bool = knob(
        False, "train LoRA adapters (peft); saved models are merged",
        peer="TRL use_peft; \u2248 TRL peft_config")
    r: int = knob(16, "LoRA rank", range="[1, inf)", peer="peft r; TRL lora_r")
    alpha: int = knob(32, "LoRA alpha", range="[1, inf)", peer="peft lora_alpha; TRL lora_alpha")
    dropout: float = knob(0.0, "LoRA dropout", range="[0, 1)",
                          peer="peft lora_dropout; TRL lora_dropout")
    target_modules: str | list[str] = knob(
        "all-linear", "modules to adapt", peer="peft target_modules; TRL lora_target_modules")


@dataclass
class ModelConfig:
    """The model to train: a local Hugging Face folder."""

    name_or_path: str = knob(
        "examples/model",
        "local Hugging Face causal-LM folder",
        peer="TRL model_name_or_path; TRL model (the trainer's argument); "
             "NeMo-RL policy.model_name",
        resume=FIXED,
    )
    dtype: str = knob(
        "float32", "float32, or bfloat16 (full fine-tuning: float32 masters under bf16 autocast)",
        choices=("float32", "bfloat16"),
        peer="TRL model_init_kwargs.dtype; NeMo-RL policy.precision", resume=FIXED)
    gradient_checkpointing: bool = knob(
        False, "recompute activations in backward", peer="TRL gradient_checkpointing", resume=FREE)
    trust_remote_code: bool = knob(
        False, "allow model code from the model folder", peer="TRL trust_remote_code", resume=FREE)
    lean_forward: bool = knob(
        True,
        "preftune's own module for the families it runs "
        "(docs/models.md; false: the Hugging Face module)",
        peer="TRL use_liger_kernel (a different kernel set)")
    compile: bool = knob(False,
                         "torch.compile each block of preftune's own module (the training passes)")
    router_aux_loss_coef: float | None = knob(
        None, "mixture of experts: weight of the routers' load-balancing loss (None: the model's "
              "config.json value; 0: off; an error on a dense model)", range="[0, inf)",
        peer="TRL router_aux_loss_coef")
    lora: LoraConfig = section(LoraConfig, resume=FIXED)


@dataclass
class DataConfig:
    """Training and evaluation data; trace columns and validation; DPO pairing and KTO labels."""

    train: str = knob(
        "",
        "prompts (online GRPO), labeled traces (DPO, KTO, SFT, offline GRPO) or a pairs file (DPO)",
        peer="\u2248 TRL train_dataset (a path here); NeMo-RL data.train_data_path")
    eval: str | None = knob(
        None, "held-out prompt set for eval/reward (greedy)",
        peer="\u2248 TRL eval_dataset (a path here)", resume=FREE)
    prompt_column: str = knob(
        "input", "prompt column (prompt is accepted when input is missing)",
        peer="NeMo-RL data.prompt_key")
    response_column: str = knob("output", "response column of traces")
    reward_column: str = knob("final_reward", "reward column of traces")
    reward_range: list[float] = knob(
        help="valid reward range of traces", range="[-inf, inf]", factory=lambda: [0.0, 1.0])
    invalid: str = knob("error", "invalid trace rows: error (exit 78) or drop (counted)",
                        choices=("error", "drop"))
    duplicates: str = knob(
        "drop", "exact duplicate trace rows: drop (counted), keep or error",
        choices=("error", "drop", "keep"))
    min_reward_threshold: float | None = knob(
        None, "leave out trace rows with a lower reward (counted)", range="(-inf, inf)",
        peer="NeMo-RL preference data min_reward_threshold")
    max_prompt_length: int = knob(512, "prompt tokens", range="[1, inf)",
                                  peer="TRL max_prompt_length")
    prompt_truncation: str = knob(
        "left", "longer prompts: left (keep the end), drop, error; counted",
        choices=("left", "drop", "error"))
    shuffle: bool = knob(True, "shuffle each epoch (seeded)")
    chosen_min: float = knob(0.7, "DPO chosen, KTO desirable: reward >= this", range="(-inf, inf)")
    rejected_max: float = knob(0.5,
                               "DPO rejected, KTO undesirable: reward < this", range="(-inf, inf)")
    pair_strategy: str = knob("best_vs_worst", "best_vs_worst or all_pairs",
                              choices=("best_vs_worst", "all_pairs"))
    max_pairs_per_prompt: int | None = knob(None, "cap for all_pairs", range="[1, inf)")
    min_margin: float = knob(0.0, "skip pairs with a smaller reward margin", range="[0, inf)")
    tools: str | None = knob(
        None,
        "JSON/YAML file of tool schemas rendered into every "
        "prompt (a row's tools column wins); docs/agents.md",
        peer="TRL tools (as JSON schemas)", resume=FIXED)


@dataclass
class DPOConfig:
    """DPO on pairs."""

    loss_type: str | list[str] = knob(
        "sigmoid", "a type or a list of types", choices=DPO_LOSS_TYPES,
        peer="TRL loss_type", resume=FIXED)
    loss_weights: list[float] | None = knob(
        None, "weights of a list of types", range="[0, inf)",
        peer="TRL loss_weights; NeMo-RL preference_loss_weight/sft_loss_weight")
    beta: float = knob(
        0.1, "DPO temperature \u03b2", range="(0, inf)",
        peer="TRL beta; NeMo-RL dpo.reference_policy_kl_penalty")
    label_smoothing: float = knob(
        0.0, "\u03b5 of robust / exo_pair / aot", range="[0, 0.5]", peer="TRL label_smoothing")
    reference_free: bool = knob(False, "no reference (log-probs 0)", peer="TRL reference_free")
    use_weighting: bool = knob(
        False,
        "WPO: weigh each pair by its responses' probability under the policy (arXiv:2406.11827)",
        peer="TRL use_weighting")
    precompute_ref_logps: bool = knob(
        True,
        "compute reference log-probs once and cache them "
        "(false: run a frozen reference on each batch)",
        peer="TRL precompute_ref_log_probs")
    max_length: int = knob(512, "prompt + response tokens", range="[2, inf)", peer="TRL max_length")
    batch_size: int = knob(
        16, "pairs per optimiser step", range="[1, inf)",
        peer="TRL per_device_train_batch_size \u00d7 gradient_accumulation_steps", resume=FIXED)
    micro_batch_size: int = knob(
        16, "pairs per forward/backward", range="[1, inf)",
        peer="\u2248 TRL per_device_train_batch_size (per process)")


@dataclass
class KTOConfig:
    """KTO on labeled traces: desirable (reward >= data.chosen_min) or undesirable (<
    data.rejected_max)."""

    loss_type: str = knob("kto", "kto, or apo_zero_unpaired (no KL reference point)",
                          choices=KTO_LOSS_TYPES, peer="TRL loss_type", resume=FIXED)
    beta: float = knob(0.1, "KTO temperature \u03b2", range="(0, inf)", peer="TRL beta")
    desirable_weight: float = knob(
        1.0, "\u03bb_D: weight of the desirable examples' losses", range="(0, inf)",
        peer="TRL desirable_weight")
    undesirable_weight: float = knob(
        1.0, "\u03bb_U: weight of the undesirable examples' losses", range="(0, inf)",
        peer="TRL undesirable_weight")
    max_length: int = knob(512, "prompt + response tokens", range="[2, inf)",
                           peer="TRL max_length", resume=FIXED)
    batch_size: int = knob(
        16,
        "examples per optimiser step; the KL reference point z is taken over them",
        range="[1, inf)",
        peer="TRL per_device_train_batch_size \u00d7 gradient_accumulation_steps",
        resume=FIXED,
    )
    micro_batch_size: int = knob(
        16, "examples per forward/backward", range="[1, inf)",
        peer="\u2248 TRL per_device_train_batch_size (per process)")


@dataclass
class SFTConfig:
    """Supervised fine-tuning."""

    min_reward: float = knob(
        0.7, "labeled traces: train on responses with reward >= this",
        range="(-inf, inf)", resume=FIXED)
    max_length: int = knob(512, "prompt + completion tokens", range="[2, inf)",
                           peer="TRL max_length", resume=FIXED)
    batch_size: int = knob(
        16, "examples per optimiser step", range="[1, inf)",
        peer="TRL per_device_train_batch_size \u00d7 gradient_accumulation_steps", resume=FIXED)
    micro_batch_size: int = knob(
        16, "examples per forward/backward", range="[1, inf)",
        peer="\u2248 TRL per_device_train_batch_size (per process)")
    packing: bool = knob(
        True, "pack several examples per row (attention within each) when it pays",
        peer="TRL packing + padding_free")
    assistant_only_loss: bool = knob(
        True,
        "multi-turn rows: train every assistant turn (its stop token included), mask "
        "system/user/tool turns; false: every token after the prompt trains",
        peer="TRL assistant_only_loss (default false there)", resume=FIXED)


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = knob(
        1e-6, "peak learning rate (AdamW)", range="[0, inf)",
        peer="TRL learning_rate; NeMo-RL policy.optimizer.kwargs.lr")
    weight_decay: float = knob(0.0, "AdamW weight decay", range="[0, inf)", peer="TRL weight_decay")
    adam_beta1: float = knob(0.9, "AdamW beta1", range="[0, 1)", peer="TRL adam_beta1")
    adam_beta2: float = knob(0.999, "AdamW beta2", range="[0, 1)", peer="TRL adam_beta2")
    adam_epsilon: float = knob(1e-8, "AdamW epsilon", range="(0, inf)", peer="TRL adam_epsilon")
    lr_scheduler: str = knob(
        "linear", "constant, linear or cosine (to 0), after warmup",
        choices=("constant", "linear", "cosine"), peer="TRL lr_scheduler_type")
    warmup_steps: int = knob(0, "linear warmup from 0", range="[0, inf)", peer="TRL warmup_steps")
    warmup_ratio: float = knob(
        0.0, "warmup as a share of max_steps (if warmup_steps is 0)", range="[0, 1]",
        peer="TRL warmup_ratio")
    max_grad_norm: float = knob(
        1.0, "global gradient clipping (0 = off)", range="[0, inf)",
        peer="TRL max_grad_norm; NeMo-RL policy.max_grad_norm")


@dataclass
class EvalConfig:
    """Held-out evaluation during training and in `preftune eval`."""

    eval_steps: int = knob(
        0, "evaluate every N steps (always before the first and after the last)", range="[0, inf)",
        peer="TRL eval_steps; NeMo-RL grpo.val_period")
    max_new_tokens: int | None = knob(None, "greedy tokens (null = grpo.max_completion_length)",
                                      range="[1, inf)")
    batch_size: int = knob(128, "prompts per eval batch", range="[1, inf)",
                           peer="\u2248 TRL per_device_eval_batch_size (per process)")
    reward_funcs: list[str] | None = knob(None, "null = grpo.reward_funcs with grpo.reward_weights")
    num_samples: int = knob(
        1,
        "k > 1: also k sampled completions per prompt at grpo.temperature (pass@k, mean@k)",
        range="[1, inf)",
    )
    split: float = knob(
        0.0,
        "without data.eval: hold out this fraction of the "
        "training prompts (chosen by prompt hash) for evaluation",
        range="[0, 1)", resume=FIXED)


@dataclass
class GateConfig:
    """The evaluation gate of `preftune eval`."""

    min_reward: float | None = knob(None, "the checkpoint's greedy reward must be >= this",
                                    range="(-inf, inf)")
    min_accuracy: float | None = knob(
        None, "held-out pairs: the checkpoint's rewards/accuracies must be >= this", range="[0, 1]")
    min_improvement: float | None = knob(
        None,
        "the improvement's lower confidence bound must be > this (needs --baseline)",
        range="(-inf, inf)",
    )
    max_length_growth: float | None = knob(
        None,
        "mean completion length, checkpoint / baseline, must be <= this (reward hacking by length)",
        range="(0, inf)")
    confidence: float = knob(
        0.95,
        "confidence level of the improvement's one-sided bootstrap lower bound", range="(0, 1)")
    bootstrap_samples: int = knob(2000, "bootstrap resamples of the prompts (seeded by seed)",
                                  range="[1, inf)")
    registry: str | None = knob(None,
                                "JSONL model registry (local path or "
                                "fsspec URL); a pass appends a record")


@dataclass
class LogConfig:
    """Metrics, the progress bar and trackers."""

    logging_steps: int = knob(1, "write metrics every N steps", range="[1, inf)",
                              peer="TRL logging_steps")
    report_to: list[str] = knob(
        help="trackers: any of tensorboard, wandb, mlflow (TRACKERS)",
        peer="TRL report_to", factory=list)
    progress_bar: bool = knob(True, "show the progress bar", peer="TRL disable_tqdm, inverted")
    project: str | None = knob(
        None,
        "W&B project / MLflow experiment (null = WANDB_PROJECT "
        "/ MLFLOW_EXPERIMENT_NAME, else preftune)",
        peer="W&B project")
    run_name: str | None = knob(
        None, "W&B / MLflow run name (null = the output_dir folder's name)", peer="TRL run_name")
    on_tracker_outage: str = knob(
        "fail",
        "a tracker unreachable at the start: fail (exit "
        "69, retryable) or local (go on with metrics.jsonl)",
        choices=("fail", "local"))


@dataclass
class DistributedConfig:
    """Data parallel under torchrun; ignored in one plain process."""

    strategy: str = knob(
        "fsdp", "fsdp (FSDP2, sharded), ddp (whole model per rank) or none (one process)",
        choices=("fsdp", "ddp", "none"),
        peer="accelerate distributed_type; NeMo-RL dtensor; verl strategy")
    backend: str = knob(
        "auto", "auto = nccl on CUDA, else gloo", choices=("auto", "nccl", "gloo"),
        peer="accelerate / torchrun backend")
    timeout_seconds: float = knob(
        600.0,
        "a collective waiting longer (a dead rank) fails the run with exit 1", range="(0, inf)",
        peer="ddp_timeout (TRL/HF)")
    reshard_after_forward: bool = knob(
        True,
        "FSDP2: free gathered parameters after each block's forward (false: faster, more memory)",
        peer="FSDP reshard_after_forward")
    cpu_offload: bool = knob(
        False,
        "FSDP2: keep parameters, gradients and the optimizer state in host memory "
        "(CPUOffloadPolicy); the optimizer step runs on the CPU",
        peer="FSDP2 CPUOffloadPolicy; verl offload_policy; NeMo-RL cpu_offload")


@dataclass
class DeployConfig:
    """Where `preftune render` and `preftune cost` place the job (Kubernetes). Defaults: the seed's
    job, 3 x p5en.48xlarge (8 H200 each) on spot capacity, gang-scheduled by Volcano."""

    name: str = knob("preftune",
                     "the Job's name (at most 40 characters); its ConfigMap is NAME-config")
    namespace: str = knob("training-pipeline", "namespace of the Job, ConfigMap, Service and PVC")
    scheduler: str = knob(
        "volcano",
        "volcano (gang-scheduled Volcano Job) or kubernetes (Indexed Job + headless Service)",
        choices=("volcano", "kubernetes"))
    queue: str = knob("training-queue", "the Volcano queue (rendered too)")
    nodes: int = knob(3, "pods, one per node", range="[1, inf)", peer="NeMo-RL cluster.num_nodes")
    gpus_per_node: int = knob(8, "GPUs each pod requests", range="[1, inf)",
                              peer="NeMo-RL cluster.gpus_per_node")
    instance_types: list[str] = knob(
        help="EC2 types the nodes may be (8 x H200 each)", factory=lambda: ["p5en.48xlarge"])
    capacity_type: str = knob("spot", "spot or on-demand", choices=("spot", "on-demand"))
    zones: list[str] = knob(help="availability zones ([] = any zone of the subnets)", factory=list)
    image: str = knob("preftune:latest",
                      "the container image (build it from the Dockerfile, push it, name it here)")
    image_pull_policy: str = knob(
        "IfNotPresent", "Always, IfNotPresent or Never",
        choices=("Always", "IfNotPresent", "Never"))
    cpu: str | int = knob("160", "CPU requested per pod")
    memory: str = knob("1600Gi", "memory requested and limited per pod")
    shm_size: str = knob("256Gi", "size of the memory-backed /dev/shm")
    efa: bool = knob(True, "request EFA devices and give the nodes EFA interfaces")
    efa_interfaces: int = knob(16, "EFA devices per node (p5en.48xlarge: 16)", range="[1, inf)")
    checkpoint_claim: str | None = knob(
        "preftune-checkpoints", "ReadWriteMany PVC for output_dir (null = checkpoint_uri only)")
    checkpoint_mount: str = knob("/checkpoints",
                                 "where the claim is mounted; a "
                                 "relative output_dir is placed under it")
    storage_class: str | None = knob(
        None, "an RWX-capable StorageClass (FSx for Lustre, EFS); null = the cluster default")
    storage_size: str = knob("1200Gi", "PVC size (FSx for Lustre's smallest)")
    env: dict[str, str | int | float | dict[str, str]] = knob(
        help="extra environment, e.g. {NCCL_DEBUG: INFO}; a credential by reference to a "
             "Kubernetes Secret: {WANDB_API_KEY: {secret: wandb, key: api-key}} (a secretKeyRef; "
             "the value never enters the config)",
        factory=dict)
    service_account: str | None = knob(None,
                                       "service account of the pods (S3 "
                                       "access through IRSA or Pod Identity)")
    labels: dict[str, str] = knob(help="labels added to every object and pod", factory=dict)
    max_retry: int = knob(
        100,
        "whole-job restarts before Volcano gives up (each "
        "spot loss is one); backoffLimit of the Indexed Job",
        range="[0, inf)")
    termination_grace_seconds: int | None = knob(
        None,
        "pods' terminationGracePeriodSeconds, above preemption_grace_seconds (null: that + 30)",
        range="[1, inf)",
    )
    node_pool: str = knob("training-spot-pool", "Karpenter NodePool name")
    node_class: str = knob("training-gpu-class", "Karpenter EC2NodeClass name")
    cluster: str = knob(
        "training-cluster",
        "EKS cluster: subnets and security groups are "
        "found by the tag karpenter.sh/discovery: CLUSTER")
    node_role: str | None = knob(None, "IAM role of the nodes; null = KarpenterNodeRole-CLUSTER")
    ami_alias: str = knob(
        "al2023@v20260807",
        "pinned EKS AMI, family@version (Karpenter picks the NVIDIA variant for GPU types)")
    root_volume_size: str = knob("200Gi", "root EBS volume (gp3, encrypted)")
    expire_after: str = knob("720h", "nodes are replaced after this (the run saves and restarts)")
    consolidate_after: str = knob("5m", "an empty node is removed after this")
    max_gpus: int | None = knob(
        None,
        "NodePool GPU limit; null = (nodes + 1) x "
        "gpus_per_node, one spare node for a spot replacement",
        range="[1, inf)")


@dataclass
class Config:
    """A preftune run."""

    algorithm: str = knob("grpo", "grpo, dpo, kto or sft",
                          choices=("grpo", "dpo", "kto", "sft"), resume=FIXED)
    output_dir: str = knob(
        "runs/preftune",
        "run folder (config.yaml, metrics.jsonl, checkpoints/, final/)", peer="TRL output_dir",
        resume=FREE)
    max_steps: int = knob(
        100, "optimiser steps", range="[1, inf)",
        peer="TRL max_steps; NeMo-RL grpo.max_num_steps", resume=FREE)
    save_steps: int = knob(
        50, "checkpoint every N steps (0 = only on preemption)", range="[0, inf)",
        peer="TRL save_steps; NeMo-RL checkpointing.save_period", resume=FREE)
    seed: int = knob(0, "seeds data order, sampling and init", range="[0, 4294967295]",
                     peer="TRL seed", resume=FIXED)
    full_determinism: bool = knob(
        False,
        "deterministic kernels everywhere (CUDA: deterministic algorithms, "
        "cuBLAS workspace, no TF32, no memory-efficient SDPA); CPU runs "
        "are bitwise reproducible without it; docs/reliability.md",
        peer="HF TrainingArguments.full_determinism")
    save_total_limit: int | None = knob(
        None, "keep the newest K checkpoints (null = all)", range="[1, inf)",
        peer="TRL save_total_limit; NeMo-RL checkpointing.keep_top_k", resume=FREE)
    resume: str = knob(
        "auto",
        "auto (newest complete checkpoint, local then checkpoint_uri), never, or a checkpoint path",
        peer="TRL resume_from_checkpoint", resume=FREE)
    overwrite_output_dir: bool = knob(
        False, "with resume: never, allow starting over in a non-empty output_dir",
        peer="TRL overwrite_output_dir", resume=FREE)
    resume_with_changes: bool = knob(
        False,
        "resume although keys that shape the training steps (on resume: "
        "trajectory) changed; each change is logged and appended to "
        "OUTPUT_DIR/config_history.jsonl (fixed keys are refused even so)", resume=FREE)
    preemption_grace_seconds: float = knob(
        60.0,
        "time from SIGTERM to the kill: finish the step if it fits, else abandon it, save, exit 75",
        range="[0, inf)", resume=FREE)
    checkpoint_uri: str | None = knob(
        None, "fsspec URL (s3://bucket/prefix) mirroring every completed checkpoint", resume=FREE)
    checkpoint_uri_timeout_seconds: float = knob(
        300.0,
        "the longest wait on checkpoint_uri: a listing or read at start, the uploads after the "
        "last step; longer (or no connection) is exit 69, retryable", range="(0, inf)", resume=FREE)
    lock_stale_seconds: float = knob(
        60.0,
        "output_dir's lock (one writer per run) from another node with no heartbeat for this long "
        "is taken over; its holder touches it every sixth of this", range="(0, inf)", resume=FREE)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig, resume=FIXED)
    grpo: GRPOConfig = section(GRPOConfig)
    dpo: DPOConfig = section(DPOConfig)
    kto: KTOConfig = section(KTOConfig)
    sft: SFTConfig = section(SFTConfig)
    optim: OptimConfig = section(OptimConfig)
    eval: EvalConfig = section(EvalConfig, resume=FREE)
    gate: GateConfig = section(GateConfig, resume=FREE)
    log: LogConfig = section(LogConfig, resume=FREE)
    distributed: DistributedConfig = section(DistributedConfig, resume=FREE)
    deploy: DeployConfig = section(DeployConfig, resume=FREE)
    config_dir: str = internal(".")  # the folder relative paths are read from
