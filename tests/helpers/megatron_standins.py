"""Stand-ins for Megatron-LM objects the hooks touch on CPU (an LR scheduler, a mixed-precision
optimizer that only constructs on CUDA, the train-step driver), shared by the Megatron tests."""


class _Sched:
    """Stands in for Megatron-LM's OptimizerParamScheduler (state_dict / load_state_dict)."""

    def __init__(self, n: int = 0):
        self.num_steps, self.max_lr = n, 1e-2

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr}

    def load_state_dict(self, sd):
        self.num_steps, self.max_lr = sd["num_steps"], sd["max_lr"]


class _MixedPrecision:
    """Duck-typed Float16OptimizerWithFloat16Params: Adam over fp32 main copies of the params
    (the real class only constructs on CUDA tensors)."""

    def __init__(self, params):
        import torch

        self.float16_groups = [list(params)]
        self.fp32_from_float16_groups = [[p.detach().clone().float() for p in self.float16_groups[0]]]
        self.optimizer = torch.optim.Adam(self.fp32_from_float16_groups[0], lr=1e-2)

    def zero_grad(self, set_to_none=True):
        for p in self.float16_groups[0]:
            p.grad = None

    def step(self):
        for p, m in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, m in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            p.data.copy_(m.data)


def _make_opt(kind: str, model):
    import torch

    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind == "fp32":
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

        opt = FP32Optimizer.__new__(FP32Optimizer)  # its __init__ allocates a CUDA tensor
        MegatronOptimizer.__init__(opt, torch.optim.Adam(model.parameters(), lr=1e-2), OptimizerConfig())
        opt.is_stub_optimizer = False
        return opt
    return _MixedPrecision(model.parameters())


class _Stepper:
    """What train_step needs: zero_grad + step on whichever object does the update."""

    def __init__(self, opt):
        self.inner = opt.optimizer if type(opt).__name__ == "FP32Optimizer" else opt

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.inner.step()
