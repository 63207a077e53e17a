//===- program/decoder.cpp - Generation from a KV cache ------------------===//
#include "program/decoder.h"

#include "ir/error.h"
#include "runtime/device_memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace frag::program {
namespace {

/// The model's forwards belong to generation step `step` (their batch rows have the stable ids `row_ids`;
/// none: "rows" are batch indices) while this lives; then to none again (a plain forward), whether the
/// forward returned or threw.
class GenerationStep {
 public:
  GenerationStep(ShardedModel& model, int64_t step, std::vector<int64_t> row_ids = {}) : model_(model) {
    model_.set_generation_step(step);
    model_.set_row_ids(std::move(row_ids));
  }
  ~GenerationStep() {
    model_.set_generation_step(std::nullopt);
    model_.set_row_ids({});
  }
  GenerationStep(const GenerationStep&) = delete;
  GenerationStep& operator=(const GenerationStep&) = delete;

 private:
  ShardedModel& model_;
};

/// Saves keep the first `rows` rows while this lives (a decode step padded to a bucket); then every row.
class RealRows {
 public:
  RealRows(ShardedModel& model, std::optional<int64_t> rows) : model_(model) { model_.set_real_rows(rows); }
  ~RealRows() { model_.set_real_rows(std::nullopt); }
  RealRows(const RealRows&) = delete;
  RealRows& operator=(const RealRows&) = delete;

 private:
  ShardedModel& model_;
};

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

Decoder::Decoder(ShardedModel& model, int64_t max_batch, int64_t max_len)
    : model_(model), max_batch_(max_batch), max_len_(max_len) {
  const auto& program = model.program();
  const auto& path = program.path();
  if (!program.has_kv_cache())
    fail("{}: this rank file's forward takes no KV cache (exported before cached generation, or a .pt2 archive "
         "exported without kv_cache=True); export it again with the kit to decode from a cache",
         path);
  if (max_batch < 1 || max_len < 1)
    fail("{}: a KV cache needs at least one row of one token, got {} rows of {} tokens", path, max_batch, max_len);
  const int64_t positions = program.max_positions();
  if (positions > 0 && max_len > positions)
    fail("{}: a cache of {} tokens is past the model's {} positions (max_position_embeddings)", path, max_len,
         positions);
  const auto shape = program.kv_cache_shape(max_batch, max_len);
  int64_t bytes = c10::elementSize(program.dtype());
  for (auto d : shape) bytes *= d;
  const torch::Device device = program.device();
  // Checked before the allocation (a CUDA allocator's refusal comes after the attempt, in its own words).
  const int64_t available = runtime::free_memory(device);
  if (available >= 0 && bytes > available)
    fail("{}: a KV cache of {} rows x {} tokens needs {} on this rank, more than the {} free on {}", path,
         max_batch, max_len, mib(bytes), mib(available), device.str());
  try {
    cache_ = torch::zeros(shape, torch::TensorOptions().dtype(program.dtype()).device(device));
  } catch (const c10::Error&) {  // a GPU's allocator refuses in words of its own: one line of ours
    fail("{}: a KV cache of {} rows x {} tokens ({} on this rank) does not fit on {}", path, max_batch, max_len,
         mib(bytes), device.str());
  }
  if (device.is_cuda()) {  // one decode graph per bucket (the captured step's shapes are the bucket's)
    std::vector<int64_t> powers;
    for (int64_t b = 1; b < max_batch; b *= 2) powers.push_back(b);
    set_batch_buckets(powers);
  }
}

void Decoder::set_batch_buckets(std::vector<int64_t> buckets) {
  for (auto b : buckets)
    if (b < 1 || b > max_batch_)
      fail("{}: a batch bucket of {} rows is outside 1..{} (the KV cache's rows)", model_.program().path(), b,
           max_batch_);
  if (!buckets.empty()) buckets.push_back(max_batch_);
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  buckets_ = std::move(buckets);
}

int64_t Decoder::bucket_for(int64_t rows) const {
  auto found = std::lower_bound(buckets_.begin(), buckets_.end(), rows);
  return found == buckets_.end() ? rows : *found;
}

std::string Decoder::describe() const {
  return fmt::format("KV cache: {} rows x {} tokens, {} layers, {} kv head{} of {} on this rank, {}: {}", max_batch_,
                     max_len_, cache_.size(0), cache_.size(3), cache_.size(3) == 1 ? "" : "s", cache_.size(5),
                     c10::toString(cache_.scalar_type()), mib(cache_bytes()));
}

torch::Tensor Decoder::run(const torch::Tensor& ids, const torch::Tensor& positions, int64_t first,
                           std::vector<int64_t> row_ids) {
  row_ids.resize(ids.size(0), -1);  // padding rows have no id
  CachedStep step;
  step.positions = positions.to(cache_.device());
  step.kv_cache = cache_.narrow(2, first, ids.size(0));
  // On a GPU a decode step attends over the whole cache (static shapes: ShardedModel replays it from a CUDA
  // graph, as transformers' StaticCache does); elsewhere over the longest row's slots only.
  step.cache_len = cache_.is_cuda() && ids.size(1) == 1 ? max_len_ : positions.max().item<int64_t>() + 1;
  torch::Tensor logits;
  {
    GenerationStep scope(model_, step_, std::move(row_ids));
    logits = model_.forward_cached(ids.to(cache_.device()), step);
  }
  ++step_;
  return logits;
}

torch::Tensor Decoder::prefill(const std::vector<std::vector<int64_t>>& prompts) {
  const auto& path = model_.program().path();
  if (prompts.empty()) fail("{}: prefill of no prompts", path);
  const int64_t n = static_cast<int64_t>(prompts.size());
  if (rows() + n > max_batch_)
    fail("{}: a batch of {} rows is past the KV cache's bound of {} rows", path, rows() + n, max_batch_);
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) fail("{}: prompt {} has no tokens", path, i);
    longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts[i].size()));
  }
  if (longest > max_len_)
    fail("{}: a prompt of {} tokens is past the KV cache's {} tokens a row", path, longest, max_len_);
  auto ids = torch::zeros({n, longest}, torch::kLong);
  auto lengths = torch::empty({n}, torch::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = prompts[i];
    ids[i].narrow(0, 0, static_cast<int64_t>(p.size()))
        .copy_(torch::tensor(std::vector<int64_t>(p.begin(), p.end()), torch::kLong));
    lengths[i] = static_cast<int64_t>(p.size());
  }
  auto positions = torch::arange(longest, torch::kLong).unsqueeze(0).expand({n, longest}).contiguous();
  const int64_t first = rows();
  std::vector<int64_t> new_ids(n);
  for (auto& id : new_ids) id = next_id_++;
  auto logits = run(ids, positions, first, new_ids);
  for (const auto& p : prompts) lengths_.push_back(static_cast<int64_t>(p.size()));
  ids_.insert(ids_.end(), new_ids.begin(), new_ids.end());
  auto last = (lengths - 1).to(logits.device());
  return logits.index({torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(logits.device())), last});
}

torch::Tensor Decoder::decode(const torch::Tensor& tokens) {
  const auto& path = model_.program().path();
  if (tokens.dim() != 1 || tokens.size(0) != rows())
    fail("{}: a decode step takes one token per row ({} rows), got a tensor of shape [{}]", path, rows(),
         fmt::join(tokens.sizes(), ", "));
  for (int64_t r = 0; r < rows(); ++r)
    if (lengths_[r] >= max_len_)
      fail("{}: row {} holds {} tokens, the KV cache's whole row: it cannot take another", path, r, lengths_[r]);
  // Padded to the bucket: the padding rows take token 0 at position 0 in cache rows past the batch (no real
  // row reads another's rows; a row that joins later overwrites its slots in its prefill).
  const int64_t padded = bucket_for(rows());
  auto positions = torch::zeros({padded, 1}, torch::kLong);
  positions.narrow(0, 0, rows()).copy_(torch::tensor(lengths_, torch::kLong).unsqueeze(1));
  auto ids = tokens.to(torch::kLong).unsqueeze(1);
  if (padded > rows()) ids = torch::cat({ids, torch::zeros({padded - rows(), 1}, ids.options())});
  torch::Tensor logits;
  {
    RealRows real(model_, padded > rows() ? std::optional<int64_t>(rows()) : std::nullopt);
    logits = run(ids, positions, 0, ids_);
  }
  for (auto& length : lengths_) ++length;
  return logits.select(1, 0).narrow(0, 0, rows());
}

void Decoder::drop(int64_t row) {
  if (row < 0 || row >= rows()) fail("{}: no row {} to drop (the batch has {})", model_.program().path(), row, rows());
  const int64_t after = rows() - row - 1;
  if (after > 0) cache_.narrow(2, row, after).copy_(cache_.narrow(2, row + 1, after).clone());
  lengths_.erase(lengths_.begin() + row);
  ids_.erase(ids_.begin() + row);
}

torch::Tensor Decoder::generate(const std::vector<std::vector<int64_t>>& prompts, int64_t steps) {
  const auto& path = model_.program().path();
  if (steps < 1) fail("{}: generate needs at least one step, got {}", path, steps);
  for (size_t i = 0; i < prompts.size(); ++i)
    if (static_cast<int64_t>(prompts[i].size()) + steps - 1 > max_len_)
      fail("{}: prompt {} of {} tokens and {} new tokens do not fit the KV cache's {} tokens a row", path, i,
           prompts[i].size(), steps, max_len_);
  auto logits = prefill(prompts);
  std::vector<torch::Tensor> out;
  auto next = logits.argmax(-1);
  out.push_back(next);
  for (int64_t s = 1; s < steps; ++s) {
    next = decode(next).argmax(-1);
    out.push_back(next);
  }
  return torch::stack(out, 1).cpu();
}

torch::Tensor Decoder::generate(const torch::Tensor& input_ids, int64_t steps) {
  if (input_ids.dim() != 2)
    fail("{}: generate takes token ids [batch, tokens], got shape [{}]", model_.program().path(),
         fmt::join(input_ids.sizes(), ", "));
  auto ids = input_ids.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < ids.size(0); ++b)
    prompts.emplace_back(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + ids.size(1));
  auto tokens = generate(prompts, steps);
  return torch::cat({input_ids, tokens.to(input_ids.device(), input_ids.scalar_type())}, 1);
}

torch::Tensor generate(ShardedModel& model, const torch::Tensor& input_ids, int64_t steps) {
  if (model.program().has_kv_cache()) {
    // One KV cache sized for this batch: a prefill and steps - 1 decode steps.
    Decoder decoder(model, input_ids.size(0), input_ids.size(1) + steps);
    return decoder.generate(input_ids, steps);
  }
  // Each step recomputes the whole sequence: forward s is generation step s (a plan step's "steps" pick
  // forwards as in cached decoding, but such a forward covers every position, prompt included), its saves
  // are keyed by the step.
  torch::Tensor tokens = input_ids;
  for (int64_t s = 0; s < steps; ++s) {
    torch::Tensor logits;
    {
      GenerationStep scope(model, s);
      logits = model.forward(tokens);
    }
    auto next = logits.select(1, logits.size(1) - 1).argmax(-1, /*keepdim=*/true).to(tokens.dtype());
    tokens = torch::cat({tokens, next}, 1);
  }
  return tokens;
}

}  // namespace frag::program
