// The keel decoder's CPU kernels (keelrl/inference/kernels.py builds and loads them).
//
// Decode attention over the slot cache: one query token per sequence, its query heads grouped by
// the kv head they share, each sequence reading its own keys and values only up to its own
// length, each key and value row read once for the whole group.
//
// decode_attention(q [N, KVH, G, D], keys [S, KVH, C, D], values [S, KVH, C, D], slots [N],
//                  lengths [N], scale) -> [N, KVH, G, D]
// Query n attends to keys[slots[n], h, 0:lengths[n]]. Scores, softmax and the weighted sum are
// float32; the output is rounded to the cache's dtype (float32 or bfloat16, rounding to nearest
// even as torch does). Parallel over (sequence, kv head) with ATen's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
// Round to nearest even, as torch rounds (NaN aside: no NaN reaches these kernels). Integer ops
// only, so that the compiler vectorises the loops around it.
inline void from_float(float x, c10::BFloat16* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  out->x = static_cast<uint16_t>(bits >> 16);
}
// x rounded to T and back: what torch's elementwise ops in T store between two ops.
template <typename T>
inline float round_to(float x) {
  T out;
  from_float(x, &out);
  return to_float(out);
}

constexpr int LANES = 16;

// D: the head dim, fixed at compile time for the common ones (64, 128); 0 reads it from q.
template <typename T, int D>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
            const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), kvh = q.size(1), groups = q.size(2);
  const int dim = D ? D : static_cast<int>(q.size(3));
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), acc(groups * dim), scores, row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kvh, h = task % kvh;
      const int64_t len = lp[i];
      const T* qrow = qp + task * groups * dim;
      T* orow = op + task * groups * dim;
      if (len <= 0) {
        for (int64_t j = 0; j < groups * dim; ++j) from_float(0.f, orow + j);
        continue;
      }
      for (int64_t j = 0; j < groups * dim; ++j) qf[j] = to_float(qrow[j]) * sc;
      scores.resize(groups * len);
      const T* krow = kp + sp[i] * ks0 + h * ks1;
      for (int64_t t = 0; t < len; ++t, krow += ks2) {
        for (int d = 0; d < dim; ++d) row[d] = to_float(krow[d]);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = qf.data() + g * dim;
          float part[LANES] = {0.f};
          int d = 0;
          for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; ++l) part[l] += qg[d + l] * row[d + l];
          float s = 0.f;
          for (int l = 0; l < LANES; ++l) s += part[l];
          for (; d < dim; ++d) s += qg[d] * row[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* sg = scores.data() + g * len;
        float top = -std::numeric_limits<float>::max();
        for (int64_t t = 0; t < len; ++t) top = sg[t] > top ? sg[t] : top;
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - top);
          total += sg[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* vrow = vp + sp[i] * vs0 + h * vs1;
      for (int64_t t = 0; t < len; ++t, vrow += vs2) {
        for (int d = 0; d < dim; ++d) row[d] = to_float(vrow[d]);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * dim;
          for (int d = 0; d < dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t j = 0; j < groups * dim; ++j) from_float(acc[j], orow + j);
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                  const at::Tensor& lengths, double scale, at::Tensor& out) {
  switch (q.size(3)) {
    case 64: attend<T, 64>(q, k, v, slots, lengths, scale, out); break;
    case 128: attend<T, 128>(q, k, v, slots, lengths, scale, out); break;
    default: attend<T, 0>(q, k, v, slots, lengths, scale, out);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "decode_attention: q, keys, values are 4-d");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: head_dim must be the inner stride");
  TORCH_CHECK(keys.size(1) == q.size(1) && keys.size(3) == q.size(3) && values.sizes() == keys.sizes(),
              "decode_attention: q [N, KVH, G, D] against keys/values [S, KVH, C, D]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "decode_attention: q, keys and values share one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && slots.is_contiguous() &&
              lengths.is_contiguous() && slots.numel() == q.size(0) && lengths.numel() == q.size(0),
              "decode_attention: slots and lengths are contiguous int64 [N]");
  TORCH_CHECK(q.device().is_cpu(), "decode_attention runs on a CPU");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < keys.size(0) && lp[i] >= 0 && lp[i] <= keys.size(2), "decode_attention: query ",
                i, " reads slot ", sp[i], " up to ", lp[i], " keys, outside the cache's ", keys.size(0), " slots of ",
                keys.size(2), " positions");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, keys, values, slots, lengths, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, keys, values, slots, lengths, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " is not float32 or bfloat16");
  }
  return out;
}

// Elementwise steps of a layer, each one op where torch runs several, each rounding to the
// tensor's dtype exactly where torch's own ops would (so a bfloat16 result equals torch's bit for
// bit, up to the order of the RMS sum).

// x += delta (when given), then LlamaRMSNorm(x): normalised in float32, rounded to x's dtype,
// scaled by weight. x [N, H] contiguous, changed in place; returns the normalised [N, H].
template <typename T>
void add_rms_norm_impl(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t n = x.size(0), h = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t i = begin; i < end; ++i) {
      T* xr = xp + i * h;
      float sq = 0.f;
      for (int64_t j = 0; j < h; ++j) {
        float v = to_float(xr[j]);
        if (dp) {
          v = round_to<T>(v + to_float(dp[i * h + j]));
          from_float(v, xr + j);
        }
        row[j] = v;
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t j = 0; j < h; ++j) from_float(to_float(wp[j]) * round_to<T>(row[j] * inv), op + i * h + j);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: x [N, H] contiguous, weight [H]");
  TORCH_CHECK(!delta || (delta->sizes() == x.sizes() && delta->is_contiguous() &&
                         delta->scalar_type() == x.scalar_type()), "add_rms_norm: delta as x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight in x's dtype");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(x, delta, weight, eps, out);
  else if (x.scalar_type() == at::kBFloat16) add_rms_norm_impl<c10::BFloat16>(x, delta, weight, eps, out);
  else TORCH_CHECK(false, "add_rms_norm: dtype ", x.scalar_type(), " is not float32 or bfloat16");
  return out;
}

// Rotary embedding of the queries and keys in qkv [N, (H + 2 KVH) D] (q, k, v side by side), as
// qk * cos + rotate_half(qk) * sin, and the rotated keys and the values written into
// keys/values [S, KVH, C, D] at (slots[n], :, positions[n]). Returns the rotated queries [N, H, D].
template <typename T>
void rope_store_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                     at::Tensor& values, const at::Tensor& slots, const at::Tensor& positions, int64_t heads,
                     int64_t kv_heads, at::Tensor& q_out) {
  const int64_t n = qkv.size(0), dim = cos.size(1), half = dim / 2, width = qkv.size(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* snp = sin.data_ptr<T>();
  T* kp = keys.data_ptr<T>();
  T* vp = values.data_ptr<T>();
  T* qp = q_out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = src + i * width;
      const T* c = cp + i * dim;
      const T* s = snp + i * dim;
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const T* x = row + head * dim;
        T* dst = head < heads ? qp + (i * heads + head) * dim
                              : kp + sp[i] * ks0 + (head - heads) * ks1 + pp[i] * ks2;
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_float(x[j]), b = to_float(x[j + half]);
          from_float(round_to<T>(a * to_float(c[j])) + round_to<T>(-b * to_float(s[j])), dst + j);
          from_float(round_to<T>(b * to_float(c[j + half])) + round_to<T>(a * to_float(s[j + half])), dst + j + half);
        }
      }
      for (int64_t head = 0; head < kv_heads; ++head)
        std::memcpy(vp + sp[i] * vs0 + head * vs1 + pp[i] * vs2, row + (heads + kv_heads + head) * dim,
                    dim * sizeof(T));
    }
  });
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                      at::Tensor values, const at::Tensor& slots, const at::Tensor& positions, int64_t heads,
                      int64_t kv_heads) {
  const int64_t dim = cos.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "rope_store: qkv [N, (heads + 2 kv_heads) head_dim] contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * dim &&
              sin.numel() == cos.numel(), "rope_store: cos and sin [N, head_dim] contiguous");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(1) == kv_heads && keys.size(3) == dim &&
              keys.stride(3) == 1 && values.stride(3) == 1, "rope_store: keys/values [S, kv_heads, C, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type() &&
              qkv.scalar_type() == keys.scalar_type() && qkv.scalar_type() == values.scalar_type(),
              "rope_store: one dtype for qkv, cos, sin and the cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.is_contiguous() &&
              positions.is_contiguous() && slots.numel() == qkv.size(0) && positions.numel() == qkv.size(0),
              "rope_store: slots and positions are contiguous int64 [N]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < qkv.size(0); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < keys.size(0) && pp[i] >= 0 && pp[i] < keys.size(2), "rope_store: token ", i,
                " writes slot ", sp[i], " position ", pp[i], ", outside the cache's ", keys.size(0), " slots of ",
                keys.size(2), " positions");
  auto q = at::empty({qkv.size(0), heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat)
    rope_store_impl<float>(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads, q);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_store_impl<c10::BFloat16>(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads, q);
  else
    TORCH_CHECK(false, "rope_store: dtype ", qkv.scalar_type(), " is not float32 or bfloat16");
  return q;
}

// silu(gate) * up of gate_up [N, 2 I] (gate, up side by side): [N, I].
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = gate_up.size(0), inner = gate_up.size(1) / 2;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gp + i * 2 * inner;
      const T* u = g + inner;
      T* o = op + i * inner;
      for (int64_t j = 0; j < inner; ++j) {
        const float x = to_float(g[j]);
        from_float(round_to<T>(x / (1.f + std::exp(-x))) * to_float(u[j]), o + j);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up [N, 2 I] contiguous");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else if (gate_up.scalar_type() == at::kBFloat16) silu_mul_impl<c10::BFloat16>(gate_up, out);
  else TORCH_CHECK(false, "silu_mul: dtype ", gate_up.scalar_type(), " is not float32 or bfloat16");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over a slot cache (see the source's header)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place, when given), then RMSNorm(x) * weight");
  m.def("rope_store", &rope_store, "rotary queries and keys; keys and values written into the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
