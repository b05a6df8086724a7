import sys; sys.path.insert(0, "/work/scratch/h6")
from harness import *
torch.manual_seed(0)
def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8)).double().train()
def nt_xent(z1, z2, t=0.5):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = z @ z.t() / t
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    tgt = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(sim, tgt)
g = torch.Generator().manual_seed(1)
N = 10
v1 = torch.randn(N, 3, 12, 12, dtype=torch.float64, generator=g); v2 = torch.randn(N, 3, 12, 12, dtype=torch.float64, generator=g)
y = torch.randint(0, 3, (N,), generator=g)
scheds = ["layerwise", "recompute", "segments", "passes", "auto", ("segments", 1)]
# 1 NT-Xent, two forwards per micro-batch
def fwd(m, b): return m(b[0]), m(b[1])
for mbs in (1, 3, 4):
    run_case(make, (v1, v2), None, mbs, schedules=scheds, name=f"ntxent-2fwd mbs{mbs}", forward_fn=fwd, batch_loss_fn=lambda o, t: nt_xent(*o))
# 2 NT-Xent one forward of both views stacked (along dim 1 as docs say)
def fwd2(m, b):
    n = b[0].shape[0]
    z = m(torch.cat([b[0], b[1]]))
    return torch.stack([z[:n], z[n:]], 1)
run_case(make, (v1, v2), None, 3, schedules=scheds, name="ntxent-1fwd", forward_fn=fwd2, batch_loss_fn=lambda o, t: nt_xent(o[:, 0], o[:, 1]))
# 3 std over batch of outputs + targets
def bl3(o, t):
    return F.cross_entropy(o["logits"], t) + o["z"].std(0).mean() + 0.1 * (o["z"] - o["z"].mean(0)).pow(2).sum() / o["z"].shape[0]
def fwd3(m, b):
    z = m(b[0]); return {"logits": z[:, :3], "z": z}
run_case(make, (v1,), None, 3, schedules=scheds, name="std+targets", forward_fn=fwd3, batch_loss_fn=bl3, targets=y)
# 4 nested list/dict outputs
def fwd4(m, b):
    z = m(b[0]); return [z, {"a": (z * 2, [z.sum(1, keepdim=True)])}]
def bl4(o, t):
    return o[0].pow(2).mean() + o[1]["a"][0].std(0).sum() + o[1]["a"][1][0].softmax(0).max()
run_case(make, (v1,), None, 4, schedules=scheds, name="nested", forward_fn=fwd4, batch_loss_fn=bl4)
