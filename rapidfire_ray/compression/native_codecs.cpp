// The 1-bit codec (mean_abs scale) on CPU in one pass per chunk: compression/native.py builds
// this file with torch.utils.cpp_extension on first use; compression/fused.py calls it.
//
// Each chunk of `chunk_size` elements is loaded once into a thread-local buffer (L1-sized):
// corrected = flat + error, its scale = pairwise_sum(|corrected|) / count (the same order as
// codec.pairwise_sum, so the result is bit-identical to the reference), then the sign bits, the
// decoded values and the residual are written in the same pass. A chunk whose sum is not finite
// (NaN/inf input, flat + error overflowing, or finite values whose sum overflows) is left
// untouched and its index returned: the caller computes those few chunks by the reference
// functions (and raises for NaN/inf input). For every other chunk the float32 clamp of the
// corrected values is a no-op, and the residual's clamp (`clamp`) is applied as the reference does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr float kMax = std::numeric_limits<float>::max();
// Buffers at least this large are written with non-temporal stores (they do not fit in cache).
constexpr int64_t kStreamBytes = int64_t(1) << 22;

inline float clampf(float v) { return std::min(std::max(v, -kMax), kMax); }

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

#ifdef __AVX2__
inline void store8(float* p, __m256 v, bool stream) {
  if (stream) _mm256_stream_ps(p, v); else _mm256_storeu_ps(p, v);
}
inline bool aligned32(const float* p) { return (reinterpret_cast<uintptr_t>(p) & 31) == 0; }
#endif

}  // namespace

// payload: (segments, row_bytes) uint8, row = [n_chunks float32 scales][ceil(m / 8) sign bytes].
// error / residual / decoded: empty tensors when absent; residual may be error itself.
// Returns the indices (segment * n_chunks + chunk) of the chunks it left to the caller.
torch::Tensor onebit_encode(const torch::Tensor& flat, const torch::Tensor& error, const torch::Tensor& residual,
                            const torch::Tensor& decoded, const torch::Tensor& payload, int64_t segments,
                            int64_t m, int64_t chunk_size, int64_t valid, bool clamp) {
  TORCH_CHECK(flat.dtype() == torch::kFloat32 && flat.is_contiguous(), "flat: contiguous float32");
  TORCH_CHECK(payload.dtype() == torch::kUInt8 && payload.is_contiguous(), "payload: contiguous uint8");
  TORCH_CHECK(chunk_size > 0 && chunk_size % 8 == 0, "chunk_size: a positive multiple of 8");
  const int64_t total = segments * m;
  for (const torch::Tensor* t : {&error, &residual, &decoded}) {
    TORCH_CHECK(t->numel() == 0 || (t->dtype() == torch::kFloat32 && t->is_contiguous() && t->numel() >= total),
                "error/residual/decoded: contiguous float32 of segments * m elements");
  }
  const float* f = flat.data_ptr<float>();
  const int64_t n = flat.numel();
  const float* e = error.numel() ? error.data_ptr<float>() : nullptr;
  float* r = residual.numel() ? residual.data_ptr<float>() : nullptr;
  float* d = decoded.numel() ? decoded.data_ptr<float>() : nullptr;
  uint8_t* out = payload.data_ptr<uint8_t>();
  const int64_t n_chunks = (m + chunk_size - 1) / chunk_size;
  const int64_t row_bytes = payload.size(1);
  TORCH_CHECK(row_bytes == 4 * n_chunks + (m + 7) / 8, "payload: one row of the codec's wire bytes per segment");
  const int64_t padded = pow2_at_least(chunk_size);
  const bool stream = total * 4 >= kStreamBytes;

  std::mutex lock;
  std::vector<int64_t> left;
  at::parallel_for(0, segments * n_chunks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> corr(padded, 0.0f), tree(std::max<int64_t>(padded / 2, 1));
    std::vector<int64_t> mine;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seg = job / n_chunks, c = job % n_chunks;
      const int64_t start = seg * m + c * chunk_size;
      const int64_t len = std::min(chunk_size, m - c * chunk_size);
      float* x = corr.data();
      int64_t j0 = 0;
      // Unclamped: a chunk whose sum below is finite holds only finite values, so clamping them
      // changes nothing; any inf (input, or flat + error overflowing) sends it to the caller.
      if (start + len <= n) {  // the common case, in loops the compiler vectorises
        const float* fp = f + start;
        if (e) {
          const float* ep = e + start;
          for (; j0 < len; ++j0) x[j0] = fp[j0] + ep[j0];
        } else {
          for (; j0 < len; ++j0) x[j0] = fp[j0];
        }
      }
      for (int64_t j = j0; j < len; ++j) {  // across the end of flat: zero padding, plus error
        const int64_t g = start + j;
        x[j] = e ? (g < n ? f[g] + e[g] : 0.0f + e[g]) : (g < n ? f[g] : 0.0f);
      }
      std::fill(x + len, x + padded, 0.0f);
      // pairwise_sum: add the right half to the left half until one value is left.
      float sum;
      if (padded == 1) {
        sum = std::fabs(x[0]);
      } else {
        float* t = tree.data();
        int64_t half = padded / 2;
        for (int64_t j = 0; j < half; ++j) t[j] = std::fabs(x[j]) + std::fabs(x[j + half]);
        for (half >>= 1; half >= 1; half >>= 1)
          for (int64_t j = 0; j < half; ++j) t[j] = t[j] + t[j + half];
        sum = t[0];
      }
      if (!std::isfinite(sum)) {
        mine.push_back(job);
        continue;
      }
      const float s = sum / static_cast<float>(len);
      uint8_t* row = out + seg * row_bytes;
      std::memcpy(row + 4 * c, &s, sizeof(float));
      uint8_t* bits = row + 4 * n_chunks + c * (chunk_size / 8);
      const int64_t n_bytes = (len + 7) / 8;
      int64_t k0 = 0;
#ifdef __AVX2__
      if (len == chunk_size && start + len <= valid && (!d || aligned32(d + start)) && (!r || aligned32(r + start))) {
        const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s), zero = _mm256_setzero_ps();
        const __m256 hi = _mm256_set1_ps(kMax), lo = _mm256_set1_ps(-kMax);
        for (; k0 < n_bytes; ++k0) {
          const __m256 v = _mm256_loadu_ps(x + 8 * k0);
          const __m256 ge = _mm256_cmp_ps(v, zero, _CMP_GE_OQ);
          bits[k0] = static_cast<uint8_t>(_mm256_movemask_ps(ge));
          const __m256 dv = _mm256_blendv_ps(neg, pos, ge);
          if (d) store8(d + start + 8 * k0, dv, stream);
          if (r) {
            __m256 res = _mm256_sub_ps(v, dv);
            if (clamp) res = _mm256_min_ps(_mm256_max_ps(res, lo), hi);
            store8(r + start + 8 * k0, res, stream);
          }
        }
      }
#endif
      for (int64_t k = k0; k < n_bytes; ++k) {
        uint8_t byte = 0;
        for (int q = 0; q < 8 && 8 * k + q < len; ++q) byte |= static_cast<uint8_t>(x[8 * k + q] >= 0.0f) << q;
        bits[k] = byte;
      }
      for (int64_t j = 8 * k0; j < len; ++j) {
        const float dv = x[j] >= 0.0f ? s : -s;
        if (d) d[start + j] = dv;
        if (r) {
          const float res = clamp ? clampf(x[j] - dv) : x[j] - dv;
          r[start + j] = start + j < valid ? res : 0.0f;
        }
      }
    }
    if (!mine.empty()) {
      std::lock_guard<std::mutex> guard(lock);
      left.insert(left.end(), mine.begin(), mine.end());
    }
  });
#ifdef __AVX2__
  _mm_sfence();  // the non-temporal stores are visible before the caller reads
#endif
  std::sort(left.begin(), left.end());
  auto result = torch::empty({static_cast<int64_t>(left.size())}, torch::kInt64);
  std::copy(left.begin(), left.end(), result.data_ptr<int64_t>());
  return result;
}

// (segments, row_bytes) payload -> out: the first out.numel() (<= segments * m) of the decoded
// (segments, m) values, float32: +scale where the bit is set, else -scale.
void onebit_decode(const torch::Tensor& payload, const torch::Tensor& out, int64_t segments, int64_t m,
                   int64_t chunk_size) {
  TORCH_CHECK(payload.dtype() == torch::kUInt8 && payload.is_contiguous(), "payload: contiguous uint8");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() <= segments * m,
              "out: contiguous float32 of at most segments * m elements");
  const uint8_t* in = payload.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t limit = out.numel();
  const int64_t n_chunks = (m + chunk_size - 1) / chunk_size;
  const int64_t row_bytes = payload.size(1);
  TORCH_CHECK(row_bytes == 4 * n_chunks + (m + 7) / 8, "payload: one row of the codec's wire bytes per segment");
  const bool stream = limit * 4 >= kStreamBytes;
  at::parallel_for(0, segments * n_chunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seg = job / n_chunks, c = job % n_chunks;
      const int64_t start = seg * m + c * chunk_size;
      const int64_t len = std::min({chunk_size, m - c * chunk_size, limit - start});
      if (len <= 0) continue;
      const uint8_t* row = in + seg * row_bytes;
      float s;
      std::memcpy(&s, row + 4 * c, sizeof(float));
      const uint8_t* bits = row + 4 * n_chunks + c * (chunk_size / 8);
      float* dst = o + start;
      int64_t k0 = 0;
#ifdef __AVX2__
      if (len == chunk_size && aligned32(dst)) {
        const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
        const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (; k0 < len / 8; ++k0) {
          const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[k0]), select);
          const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, select));
          store8(dst + 8 * k0, _mm256_blendv_ps(neg, pos, set), stream);
        }
      }
#endif
      for (int64_t j = 8 * k0; j < len; ++j) dst[j] = (bits[j / 8] >> (j % 8)) & 1 ? s : -s;
    }
  });
#ifdef __AVX2__
  _mm_sfence();
#endif
}

// The mean of the rows' decoded values, element by element: out[i] = (d_0[i] + d_1[i] + ... +
// d_{S-1}[i]) / S, added in row order and divided once (the reference's rounding), for the first
// out.numel() (<= m) elements; no (segments, m) intermediate is written.
void onebit_decode_mean(const torch::Tensor& payload, const torch::Tensor& out, int64_t segments, int64_t m,
                        int64_t chunk_size) {
  TORCH_CHECK(payload.dtype() == torch::kUInt8 && payload.is_contiguous(), "payload: contiguous uint8");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() <= m,
              "out: contiguous float32 of at most m elements");
  TORCH_CHECK(segments > 0, "segments: at least one row");
  const uint8_t* in = payload.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t limit = out.numel();
  const int64_t n_chunks = (m + chunk_size - 1) / chunk_size;
  const int64_t row_bytes = payload.size(1);
  TORCH_CHECK(row_bytes == 4 * n_chunks + (m + 7) / 8, "payload: one row of the codec's wire bytes per segment");
  const bool stream = limit * 4 >= kStreamBytes;
  const float world = static_cast<float>(segments);
  at::parallel_for(0, n_chunks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(segments);
    std::vector<const uint8_t*> bits(segments);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * chunk_size;
      const int64_t len = std::min({chunk_size, m - start, limit - start});
      if (len <= 0) continue;
      for (int64_t r = 0; r < segments; ++r) {
        const uint8_t* row = in + r * row_bytes;
        std::memcpy(&scale[r], row + 4 * c, sizeof(float));
        bits[r] = row + 4 * n_chunks + c * (chunk_size / 8);
      }
      float* dst = o + start;
      int64_t k0 = 0;
#ifdef __AVX2__
      if (len == chunk_size && aligned32(dst)) {
        const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 divisor = _mm256_set1_ps(world);
        for (; k0 < len / 8; ++k0) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t r = 0; r < segments; ++r) {
            const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[r][k0]), select);
            const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, select));
            const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-scale[r]), _mm256_set1_ps(scale[r]), set);
            acc = r == 0 ? v : _mm256_add_ps(acc, v);
          }
          store8(dst + 8 * k0, _mm256_div_ps(acc, divisor), stream);
        }
      }
#endif
      for (int64_t j = 8 * k0; j < len; ++j) {
        float acc = 0.0f;
        for (int64_t r = 0; r < segments; ++r) {
          const float v = (bits[r][j / 8] >> (j % 8)) & 1 ? scale[r] : -scale[r];
          acc = r == 0 ? v : acc + v;
        }
        dst[j] = acc / world;
      }
    }
  });
#ifdef __AVX2__
  _mm_sfence();
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("onebit_encode", &onebit_encode);
  module.def("onebit_decode", &onebit_decode);
  module.def("onebit_decode_mean", &onebit_decode_mean);
}
