// Prefix-tree packing: the trie builder behind rlvr_kernels.packing.
//
// A row (one data-parallel rank's forward) folds its samples into a trie so a token shared by
// several samples is forwarded once. Two node keys:
//   - token+next (TRL 1.16's TreeRow): a node is keyed on (token, next token), the last token of a
//     sample on (token, END). The trie forks one token before samples diverge, every node has one
//     next-token label and every sample ends on a leaf.
//   - token: a node is keyed on its token alone (maximal sharing); a branch node then predicts
//     several targets and a sample may end on an inner node.
// Roots may be keyed on a group too (sharing restricted to one group).
//
// The layout is TRL's: DFS pre-order with children in insertion order, unary chains merged into
// segments (a segment ends at a branch, a leaf or a sample end), each segment's root-to-segment
// path of packed positions laid end to end for the gathered-K/V attention path.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace rlvr {

// Batch build: samples [B] given as flat `tokens` [T] (int64, >= 0) with offsets `cu_tokens`
// [B+1], the trained tokens as a mask `trained` [T] (bool) or as each sample's first trained
// position (int64 [B]), `group` [B] (int64 >= 0, or empty for no restriction) and
// rows as consecutive ranges `row_cu` [R+1] of the sample indices `order` (row r packs samples
// order[row_cu[r]:row_cu[r+1]], in that order). Rows are built in parallel; each row's output
// is the same whatever the thread count. Optional float32 `token_values` [T, C] and `sample_values`
// [B, C'] are gathered to the targets. Returns the rows' layouts concatenated (see packing.cpp).
std::vector<torch::Tensor> prefix_tree_build_cpu(const torch::Tensor& tokens, const torch::Tensor& cu_tokens,
                                                 const torch::Tensor& trained, const torch::Tensor& group,
                                                 const torch::Tensor& order, const torch::Tensor& row_cu,
                                                 const std::optional<torch::Tensor>& token_values,
                                                 const std::optional<torch::Tensor>& sample_values, bool next_key);

struct Trie;

// The incremental form for planners (TreeRowBuilder's fits/add/pack): one row, samples added one at
// a time. Its inputs come already read and checked (packing_py.cpp, the Python binding, is the
// entry point that reads and checks them); `group` is -1 (shared roots) or a group code >= 0.
class PrefixTrie {
 public:
  explicit PrefixTrie(bool next_key);
  ~PrefixTrie();
  PrefixTrie(const PrefixTrie&) = delete;
  PrefixTrie& operator=(const PrefixTrie&) = delete;
  // Leading tokens of ids[0:n] already in the trie under root key `group`.
  int64_t match(const int64_t* ids, int64_t n, int64_t group) const;
  // Adds a sample: its n tokens and trained flags (0/1), copied.
  void add(const int64_t* ids, const uint8_t* trained, int64_t n, int64_t group);
  int64_t num_nodes() const;
  int64_t num_samples() const;
  int64_t load() const;
  int64_t trained() const;
  const std::vector<int64_t>& cu() const { return cu_; }  // sample offsets [B+1] in the added tokens
  torch::Tensor node_tokens() const;
  std::vector<torch::Tensor> layout() const;  // outputs 0-14 of prefix_tree_build_cpu, one row

 private:
  Trie* trie_;
  std::vector<int64_t> tokens_;
  std::vector<uint8_t> trained_;
  std::vector<int64_t> cu_{0};
};

}  // namespace rlvr
