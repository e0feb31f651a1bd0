"""The chapter's PyTorch code (sec. 12.5), timed on CPU for ``mgpu bench train --compare torch``.

Runs in a separate interpreter (any Python with torch and NumPy) and must never import mgpu: it
reads the Fashion-MNIST IDX files with the NumPy-only ``rival_common.py`` (which also gives the
batches and the timing loop every side of the bench shares) and prints one JSON object on
stdout. Two variants:
``chapter`` is the section's code (lenet, get_params, allreduce, split_batch, train_batch) with
k "devices" that are all the CPU, so the shards run one after the other; ``idiomatic`` is
nn.Sequential + optim.SGD on one device; ``resnet18`` and ``resnet18-compile`` are the concise
chapter's network (sec. 12.6: d2l's Residual and resnet18(10, 1), no max-pool, normal_(std=0.01)
init, CrossEntropyLoss() and optim.SGD) on one device, eager and through torch.compile
(``resnet18-autocast``: eager, the forward under ``torch.autocast("cpu", torch.bfloat16)``).
All see batches (B, 1, 28, 28) float32 in [0, 1], gathered with NumPy from arrays already in
memory, so they time the training step alone. ``loader`` is the chapter's code on one device
fed as the chapter feeds it: d2l.load_data_fashion_mnist's DataLoader (shuffled, 4 worker
processes, each image converted to a float tensor one at a time as ToTensor does; torchvision
itself is not needed), timed in its steady state (workers kept alive across epochs, so their
start-up is not counted).
"""
import sys

try:  # imported as mgpu.bench.torch_rival
    from . import rival_common as common
except ImportError:  # run by path: bench train's launcher has loaded it as a top-level module
    import rival_common as common


# --- the chapter's code (sec. 12.5.3-12.5.6), PyTorch flavour --------------------------------

def make_chapter(torch, nn, F):
    """The section's functions, as the book writes them; CPU-only changes are marked."""
    loss = nn.CrossEntropyLoss(reduction='none')

    def lenet(X, params):
        h1_conv = F.conv2d(input=X, weight=params[0], bias=params[1])
        h1_activation = F.relu(h1_conv)
        h1 = F.avg_pool2d(input=h1_activation, kernel_size=(2, 2), stride=(2, 2))
        h2_conv = F.conv2d(input=h1, weight=params[2], bias=params[3])
        h2_activation = F.relu(h2_conv)
        h2 = F.avg_pool2d(input=h2_activation, kernel_size=(2, 2), stride=(2, 2))
        h2 = h2.reshape(h2.shape[0], -1)
        h3_linear = torch.mm(h2, params[4]) + params[5]
        h3 = F.relu(h3_linear)
        y_hat = torch.mm(h3, params[6]) + params[7]
        return y_hat

    def get_params(params, device):
        # CPU change: p.to('cpu') returns p itself, which would make every "device" share one
        # replica; copy=True gives each its own, as a second GPU would.
        new_params = [p.to(device, copy=True) for p in params]
        for p in new_params:
            p.requires_grad_()
        return new_params

    def allreduce(data):
        for i in range(1, len(data)):
            data[0][:] += data[i].to(data[0].device)
        for i in range(1, len(data)):
            data[i][:] = data[0].to(data[i].device)

    def split_batch(X, y, devices):
        # CPU change: nn.parallel.scatter needs CUDA; tensor_split cuts the same shards.
        assert X.shape[0] == y.shape[0]
        return (list(torch.tensor_split(X, len(devices))),
                list(torch.tensor_split(y, len(devices))))

    def sgd(params, lr, batch_size):  # d2l.sgd
        with torch.no_grad():
            for param in params:
                param -= lr * param.grad / batch_size
                param.grad.zero_()

    def train_batch(X, y, device_params, devices, lr):
        X_shards, y_shards = split_batch(X, y, devices)
        # Loss is calculated separately on each GPU
        ls = [loss(lenet(X_shard, device_W), y_shard).sum()
              for X_shard, y_shard, device_W in zip(
                  X_shards, y_shards, device_params)]
        for l in ls:  # Backpropagation is performed separately on each GPU
            l.backward()
        # Sum all gradients from each GPU and broadcast them to all GPUs
        with torch.no_grad():
            for i in range(len(device_params[0])):
                allreduce([device_params[c][i].grad for c in range(len(devices))])
        # The model parameters are updated separately on each GPU
        for param in device_params:
            sgd(param, lr, X.shape[0])  # Here, we use a full-size batch
        return ls

    return get_params, train_batch


def chapter_params(torch, seed):
    torch.manual_seed(seed)
    scale = 0.01
    W1 = torch.randn(size=(20, 1, 3, 3)) * scale
    b1 = torch.zeros(20)
    W2 = torch.randn(size=(50, 20, 5, 5)) * scale
    b2 = torch.zeros(50)
    W3 = torch.randn(size=(800, 128)) * scale
    b3 = torch.zeros(128)
    W4 = torch.randn(size=(128, 10)) * scale
    b4 = torch.zeros(10)
    return [W1, b1, W2, b2, W3, b3, W4, b4]


def idiomatic_model(torch, nn, seed):
    """The same LeNet as nn.Sequential, initialised as the chapter does: N(0, 0.01^2), zero bias."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))
    for m in net:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)
    return net


def d2l_resnet18(torch, nn, F, seed, num_classes=10, in_channels=1):
    """The concise chapter's ResNet-18 (sec. 12.6), as d2l writes it, initialised as it does."""
    class Residual(nn.Module):
        def __init__(self, input_channels, num_channels, use_1x1conv=False, strides=1):
            super().__init__()
            self.conv1 = nn.Conv2d(input_channels, num_channels, kernel_size=3, padding=1,
                                   stride=strides)
            self.conv2 = nn.Conv2d(num_channels, num_channels, kernel_size=3, padding=1)
            self.conv3 = (nn.Conv2d(input_channels, num_channels, kernel_size=1, stride=strides)
                          if use_1x1conv else None)
            self.bn1 = nn.BatchNorm2d(num_channels)
            self.bn2 = nn.BatchNorm2d(num_channels)

        def forward(self, X):
            Y = F.relu(self.bn1(self.conv1(X)))
            Y = self.bn2(self.conv2(Y))
            if self.conv3:
                X = self.conv3(X)
            Y += X
            return F.relu(Y)

    def resnet_block(in_channels, out_channels, num_residuals, first_block=False):
        blk = []
        for i in range(num_residuals):
            if i == 0 and not first_block:
                blk.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
            else:
                blk.append(Residual(out_channels, out_channels))
        return nn.Sequential(*blk)

    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(64), nn.ReLU())
    net.add_module("resnet_block1", resnet_block(64, 64, 2, first_block=True))
    net.add_module("resnet_block2", resnet_block(64, 128, 2))
    net.add_module("resnet_block3", resnet_block(128, 256, 2))
    net.add_module("resnet_block4", resnet_block(256, 512, 2))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))

    def init_weights(m):
        if type(m) in [nn.Linear, nn.Conv2d]:
            nn.init.normal_(m.weight, std=0.01)

    net.apply(init_weights)
    return net


# --- timing --------------------------------------------------------------------------------

def torch_batches(torch, images, labels, batch_size, limit, seed):
    """The shared shuffled batches (common.Batches: gathered and scaled with NumPy, as every side
    of the bench gathers them) as torch tensors, without a copy."""
    return common.Batches(images, labels, batch_size, limit, seed,
                          make=lambda X, y: (torch.from_numpy(X), torch.from_numpy(y)))


class LoaderBatches:
    """Batches from torch's DataLoader over per-image items, as the chapter's d2l loader makes
    them (ToTensor: uint8 (28, 28) -> float32 (1, 28, 28) in [0, 1], one image per __getitem__)."""

    def __init__(self, torch, images, labels, batch_size, limit, seed, workers=4):
        class Images(torch.utils.data.Dataset):
            def __len__(self):
                return len(labels)

            def __getitem__(self, i):
                x = torch.from_numpy(images[i]).to(torch.float32).div(255.0).unsqueeze(0)
                return x, int(labels[i])

        g = torch.Generator()
        g.manual_seed(seed)
        self.loader = torch.utils.data.DataLoader(
            Images(), batch_size, shuffle=True, num_workers=workers, generator=g,
            persistent_workers=True)
        full = (len(labels) + batch_size - 1) // batch_size
        self.full_batches = full
        self.num_batches = min(full, limit) if limit else full
        self._it = None

    def epoch(self, num_batches=None):
        n = num_batches or self.num_batches
        for _ in range(n):
            try:
                yield next(self._it)
            except (StopIteration, TypeError):  # first use, or the data went round once
                self._it = iter(self.loader)
                yield next(self._it)


def main(argv=None):
    args = common.rival_arguments(argv, __doc__, "chapter,idiomatic,loader",
                                  "torch.set_num_threads")

    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.set_num_threads(args.threads)
    images, labels, load_sec = common.load_images(args)
    batches = torch_batches(torch, images, labels, args.batch_size, args.limit_batches, args.seed)

    results = []
    variants = [v for v in args.variants.split(",") if v]
    if "chapter" in variants:
        get_params, train_batch = make_chapter(torch, nn, F)
        for k in [int(s) for s in args.devices.split(",") if s]:
            devices = [torch.device("cpu")] * k
            device_params = [get_params(chapter_params(torch, args.seed), d) for d in devices]

            def step(X, y, device_params=device_params, devices=devices):
                ls = train_batch(X, y, device_params, devices, args.lr)
                return sum(l.item() for l in ls)

            r = common.run_config(f"torch chapter, {k} device{'s' if k > 1 else ''}", step, batches,
                           args.epochs, args.warmup)
            r.update(variant="chapter", num_devices=k, global_batch=args.batch_size)
            results.append(r)
    if "loader" in variants:
        get_params, train_batch = make_chapter(torch, nn, F)
        device_params = [get_params(chapter_params(torch, args.seed), torch.device("cpu"))]
        fed = LoaderBatches(torch, images, labels, args.batch_size, args.limit_batches, args.seed)

        def step(X, y):
            ls = train_batch(X, y, device_params, [torch.device("cpu")], args.lr)
            return sum(l.item() for l in ls)

        r = common.run_config("torch chapter + its DataLoader (4 workers), 1 device", step, fed,
                       args.epochs, args.warmup)
        r.update(variant="loader", num_devices=1, global_batch=args.batch_size)
        results.append(r)
    if "idiomatic" in variants:
        net = idiomatic_model(torch, nn, args.seed)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        mean_loss = nn.CrossEntropyLoss()

        def step(X, y):
            opt.zero_grad()
            l = mean_loss(net(X), y)
            l.backward()
            opt.step()
            return l.item() * X.shape[0]

        r = common.run_config("torch nn.Sequential + optim.SGD", step, batches, args.epochs,
                              args.warmup)
        r.update(variant="idiomatic", num_devices=1, global_batch=args.batch_size)
        results.append(r)
    for variant in ("resnet18", "resnet18-compile", "resnet18-autocast"):
        if variant not in variants:
            continue
        net = d2l_resnet18(torch, nn, F, args.seed)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        mean_loss = nn.CrossEntropyLoss()
        model = torch.compile(net) if variant == "resnet18-compile" else net

        # resnet18-autocast: eager under CPU autocast in bfloat16 (conv and linear in bf16).
        bf16 = variant == "resnet18-autocast"

        def step(X, y, model=model, opt=opt, mean_loss=mean_loss, bf16=bf16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                l = mean_loss(model(X), y)
            l.backward()
            opt.step()
            return l.item() * X.shape[0]

        name = "torch ResNet-18" + (", torch.compile" if variant == "resnet18-compile" else
                                    ", eager autocast bf16" if bf16 else ", eager")
        r = common.run_config(name, step, batches, args.epochs, args.warmup)
        r.update(variant=variant, num_devices=1, global_batch=args.batch_size,
                 peak_rss_bytes=common.peak_rss_bytes())
        results.append(r)

    # The kernels' instruction set PyTorch picked (ATEN_CPU_CAPABILITY overrides it).
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    common.print_result(results, load_sec, torch_version=torch.__version__,
                        threads=torch.get_num_threads(),
                        cpu_capability=capability() if capability else "?")
    return 0


if __name__ == "__main__":
    sys.exit(main())
