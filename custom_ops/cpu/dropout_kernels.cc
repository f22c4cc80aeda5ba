// CPU kernels of TfmetalExt>Dropout and TfmetalExt>DropoutGrad.
//
// One Philox block gives the mask of 4 consecutive elements
// (tfmetal/dropout.h), so the element range is split over TF's CPU thread
// pool in whole draws of kPhiloxMaxGroups x kPhiloxLanes blocks
// (cpu/philox_lanes.h: 4 groups of 16 blocks in vector registers, their rounds
// interleaved): each shard skips to its first block and needs
// no other state, and the result does not depend on the number of threads.
// y may reuse x's buffer (each element is read before it is written).
//
// Helpers live in namespace dropout_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <cstdint>
#include <string>

#include "cpu/cpu_common.h"
#include "cpu/philox_lanes.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/dropout.h"

namespace tfmetal_ext {
namespace dropout_cpu {

// Philox blocks per draw, rough cycles per draw (10 rounds) and its 4 elements per block, for the
// thread pool's sharding.
constexpr int kDrawBlocks = kPhiloxLanes * kPhiloxMaxGroups;
constexpr int64_t kGroupCost = 25 * kDrawBlocks;
constexpr int64_t kGroupElements = 4 * kDrawBlocks;

// Both ops are the same map of their first input: y = kept ? x * scale : 0.
template <typename T>
class DropoutOp : public OpKernel {
 public:
  explicit DropoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rate", &rate_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    const std::string error = DropoutAttrsError(rate_, scale_);
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    int64_t s0 = 0, s1 = 0;
    OP_REQUIRES_OK(ctx, ReadSeed(ctx->input(1), &s0, &s1));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const int64_t n = x.NumElements();
    const T* in = x.flat<T>().data();
    T* out = y->flat<T>().data();
    const dropout_stream stream = dropout_stream_from_seed(s0, s1);
    const float rate = rate_, scale = scale_;
    ParallelFor(ctx, (n + kGroupElements - 1) / kGroupElements, kGroupCost, [=](int64_t begin, int64_t end) {
      uint32_t c0[kDrawBlocks], c1[kDrawBlocks], c2[kDrawBlocks], c3[kDrawBlocks];
      uint32_t words[kGroupElements];  // element e of the group: word e % 4 of block e / 4
      for (int64_t group = begin; group < end; ++group) {
        const uint64_t g0 = static_cast<uint64_t>(group) * kDrawBlocks;
        for (int l = 0; l < kDrawBlocks; ++l) {  // dropout_block's counters
          const tfm_philox_block ctr = tfm_philox_skip(stream.counter, g0 + static_cast<uint64_t>(l));
          c0[l] = ctr.w[0];
          c1[l] = ctr.w[1];
          c2[l] = ctr.w[2];
          c3[l] = ctr.w[3];
        }
        PhiloxLanes(c0, c1, c2, c3, stream.key[0], stream.key[1], kPhiloxMaxGroups);
        for (int l = 0; l < kDrawBlocks; ++l) {
          words[4 * l + 0] = c0[l];
          words[4 * l + 1] = c1[l];
          words[4 * l + 2] = c2[l];
          words[4 * l + 3] = c3[l];
        }
        const int64_t first = group * kGroupElements;
        const int64_t count = n - first < kGroupElements ? n - first : kGroupElements;
        for (int64_t j = 0; j < count; ++j) {
          out[first + j] = FromFloat<T>(dropout_element(ToFloat(in[first + j]), words[j], MantissaBits<T>(), rate, scale));
        }
      }
    });
  }

 private:
  float rate_ = 0.0f;
  float scale_ = 1.0f;
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Dropout"), DropoutOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>DropoutGrad"), DropoutOp)

}  // namespace dropout_cpu
}  // namespace tfmetal_ext
