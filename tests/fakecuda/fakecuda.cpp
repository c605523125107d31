// Fake CUDA for a CPU-only PyTorch build, for tests only: lets the autograd engine run on
// FakeTensorMode tensors whose device is "cuda". It registers PyTorch's own fake device
// guard (device and stream bookkeeping, no kernels, no memory) for CUDA, and CUDA hooks
// that say CUDA is built (the engine picks its accelerator from them) but not available.
// Loaded with ctypes before `import torch` (tests/fakecuda/__init__.py builds it).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace {
struct PxformFakeCudaHooks : public at::CUDAHooksInterface {
  explicit PxformFakeCudaHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  c10::DeviceIndex deviceCount() const override {
    return c10::impl::kFakeGuardImplMaxDevices;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", PxformFakeCudaHooks);
}
