def test_a_probe_trial_can_backpropagate_when_the_caller_runs_under_no_grad() -> None:
    import torch

    from thundersync.kernels import probe as probing

    def trial() -> None:
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()
        assert x.grad is not None

    with torch.no_grad():
        cap = probing.probe("test-no-grad-trial", torch.device("cpu"), torch.float32, "tiny", trial)
    assert cap.ok, cap.why
