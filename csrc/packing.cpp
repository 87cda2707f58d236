// Prefix-tree packing: the trie (an open-addressing hash on (parent, token, next)) and TRL's layout.
//
// Outputs of prefix_tree_build_cpu, each the rows' parts laid end to end (N forwarded tokens, S
// segments, K gathered K/V rows, M targets, B samples of a row; indices are row-local except
// target_src):
//   0 input_ids [N] i64       1 position_ids [N] i64      2 shift_labels [N] i64 (-100: untrained,
//                                                           or several different targets)
//   3 leave [N] i32 (end of the node's subtree in packed order; enter is the packed position)
//   4 cu_seqlens_q [S+1] i32  5 segment_parent [S] i32 (-1: a root)
//   6 kv_index [K] i64        7 cu_seqlens_k [S+1] i32
//   8 gather_index [T] i64 (packed position of every input token, in input order)
//   9 token_index [M] i64    10 target_ids [M] i64      11 token_pos [M] i64 (position in its sample)
//  12 segment_id [M] i64 (sample within the row)        13 target_src [M] i64 (index into tokens)
//  14 cu_seqlens [B+1] i32 (targets per sample)         15 row_sizes [R, 7] i64:
//                                                          N, S, K, M, load, longest segment, longest path
#include "packing.h"

#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace rlvr {
namespace {

constexpr int64_t kEnd = -1;  // the "next token" of a sample's last token (TRL's None)
constexpr int64_t kIgnore = -100;

inline uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Open addressing with linear probing; load kept at or under 1/2. The key's parent is the parent
// node, or -2 - group for a root (-1 without groups), so roots of different groups never meet.
class ChildTable {
 public:
  ChildTable() { resize(64); }

  int32_t find(int64_t parent, int64_t tok, int64_t next) const {
    for (size_t i = slot(parent, tok, next);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.child < 0) return -1;
      if (e.parent == parent && e.tok == tok && e.next == next) return e.child;
    }
  }

  void insert(int64_t parent, int64_t tok, int64_t next, int32_t child) {
    if (2 * (count_ + 1) > entries_.size()) resize(2 * entries_.size());
    size_t i = slot(parent, tok, next);
    while (entries_[i].child >= 0) i = (i + 1) & mask_;
    entries_[i] = {parent, tok, next, child};
    ++count_;
  }

 private:
  struct Entry {
    int64_t parent, tok, next;
    int32_t child;
  };
  size_t slot(int64_t parent, int64_t tok, int64_t next) const {
    return mix(static_cast<uint64_t>(parent) * 0x9E3779B97F4A7C15ULL ^ mix(static_cast<uint64_t>(tok)) ^
               (static_cast<uint64_t>(next) * 0xC2B2AE3D27D4EB4FULL)) &
           mask_;
  }
  void resize(size_t cap) {
    std::vector<Entry> old = std::move(entries_);
    entries_.assign(cap, Entry{0, 0, 0, -1});
    mask_ = cap - 1;
    count_ = 0;
    for (const Entry& e : old)
      if (e.child >= 0) insert(e.parent, e.tok, e.next, e.child);
  }
  std::vector<Entry> entries_;
  size_t mask_ = 0, count_ = 0;
};

struct RowLayout {
  std::vector<int64_t> input_ids, position_ids, shift_labels, kv_index, gather_index;
  std::vector<int32_t> leave, cu_q{0}, parent, cu_k{0}, cu_seqlens{0};
  std::vector<int64_t> token_index, target_ids, token_pos, segment_id, target_src;
  int64_t load = 0, max_q = 0, max_k = 0;
};

// A sample list as pointers into flat arrays: sample b is [cu[b], cu[b+1]) of ids/trained, and
// `base` is added to make target_src global.
struct Samples {
  const int64_t* ids;
  const uint8_t* trained;
  const int64_t* cu;
  int64_t num, base;
};

}  // namespace

struct Trie {
  explicit Trie(bool next_key) : next_key(next_key) {}

  bool next_key;
  std::vector<int64_t> tok;
  std::vector<int32_t> first_child, last_child, next_sibling, num_children;
  std::vector<uint8_t> ends;            // a sample ends on this node
  int32_t first_root = -1, last_root = -1;
  std::vector<int32_t> nodes;           // node of every added token, in order
  ChildTable table;
  int64_t load = 0, trained = 0;

  int64_t next_of(const int64_t* ids, int64_t n, int64_t p) const {
    return next_key ? (p + 1 < n ? ids[p + 1] : kEnd) : 0;
  }
  static int64_t root_key(int64_t group) { return group < 0 ? -1 : -2 - group; }

  int64_t match(const int64_t* ids, int64_t n, int64_t group) const {
    int64_t parent = root_key(group);
    for (int64_t p = 0; p < n; ++p) {
      const int32_t child = table.find(parent, ids[p], next_of(ids, n, p));
      if (child < 0) return p;
      parent = child;
    }
    return n;
  }

  void add(const int64_t* ids, const uint8_t* mask, int64_t n, int64_t group) {
    int64_t key = root_key(group);
    int32_t parent = -1;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t next = next_of(ids, n, p);
      int32_t child = table.find(key, ids[p], next);
      if (child < 0) {
        TORCH_CHECK(tok.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    "pack_prefix_tree: a row holds more than 2^31 - 1 unique tokens");
        child = static_cast<int32_t>(tok.size());
        table.insert(key, ids[p], next, child);
        tok.push_back(ids[p]);
        first_child.push_back(-1);
        last_child.push_back(-1);
        next_sibling.push_back(-1);
        num_children.push_back(0);
        ends.push_back(0);
        link(parent, child);
        load += p + 1;
      }
      nodes.push_back(child);
      key = parent = child;
    }
    if (n > 0) ends[parent] = 1;
    for (int64_t p = 0; p < n; ++p) trained += mask[p] != 0;
  }

  void link(int32_t parent, int32_t child) {
    int32_t& first = parent < 0 ? first_root : first_child[parent];
    int32_t& last = parent < 0 ? last_root : last_child[parent];
    if (last < 0)
      first = child;
    else
      next_sibling[last] = child;
    last = child;
    if (parent >= 0) ++num_children[parent];
  }

  RowLayout layout(const Samples& s) const;
};

namespace {

struct Frame {
  int32_t node, parent_segment, depth;
};

}  // namespace

// DFS pre-order over segments (children in insertion order), then the loss terms of every sample.
RowLayout Trie::layout(const Samples& s) const {
  RowLayout out;
  const int64_t n_nodes = static_cast<int64_t>(tok.size());
  std::vector<int32_t> packed(n_nodes), segment_of(n_nodes);
  out.input_ids.reserve(n_nodes);
  out.position_ids.reserve(n_nodes);
  std::vector<Frame> stack;
  auto push_children = [&](int32_t first, int32_t segment, int32_t depth) {
    const size_t mark = stack.size();
    for (int32_t c = first; c >= 0; c = next_sibling[c]) stack.push_back({c, segment, depth});
    std::reverse(stack.begin() + mark, stack.end());  // popped in insertion order
  };
  push_children(first_root, -1, 0);
  while (!stack.empty()) {
    Frame f = stack.back();
    stack.pop_back();
    const int32_t segment = static_cast<int32_t>(out.parent.size());
    const int64_t start = static_cast<int64_t>(out.input_ids.size());
    int32_t node = f.node, depth = f.depth;
    while (true) {
      packed[node] = static_cast<int32_t>(out.input_ids.size());
      segment_of[node] = segment;
      out.input_ids.push_back(tok[node]);
      out.position_ids.push_back(depth++);
      if (num_children[node] != 1 || ends[node]) break;
      node = first_child[node];
    }
    const int64_t end = static_cast<int64_t>(out.input_ids.size());
    out.cu_q.push_back(static_cast<int32_t>(end));
    out.parent.push_back(f.parent_segment);
    if (f.parent_segment >= 0) {  // the parent's path, then this segment
      const int64_t a = out.cu_k[f.parent_segment], b = out.cu_k[f.parent_segment + 1];
      for (int64_t i = a; i < b; ++i) out.kv_index.push_back(out.kv_index[i]);
    }
    for (int64_t i = start; i < end; ++i) out.kv_index.push_back(i);
    TORCH_CHECK(out.kv_index.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "pack_prefix_tree: the gathered K/V index of a row exceeds 2^31 - 1 entries (TRL's int32 "
                "tree_cu_seqlens_k); split the row");
    out.cu_k.push_back(static_cast<int32_t>(out.kv_index.size()));
    out.max_q = std::max(out.max_q, end - start);
    out.max_k = std::max<int64_t>(out.max_k, out.cu_k[segment + 1] - out.cu_k[segment]);
    push_children(first_child[node], segment, depth);
  }

  // A segment's subtree ends where its last descendant ends; children come after their parent.
  const int64_t n_seg = static_cast<int64_t>(out.parent.size());
  std::vector<int32_t> subtree_end(out.cu_q.begin() + 1, out.cu_q.end());
  for (int64_t g = n_seg - 1; g >= 0; --g)
    if (out.parent[g] >= 0) subtree_end[out.parent[g]] = std::max(subtree_end[out.parent[g]], subtree_end[g]);
  out.leave.resize(n_nodes);
  for (int64_t i = 0; i < n_nodes; ++i) out.leave[packed[i]] = subtree_end[segment_of[i]];

  // Loss terms, sample-major: a trained token p >= 1 is predicted by the node of token p - 1.
  out.shift_labels.assign(n_nodes, kIgnore);
  std::vector<uint8_t> conflict(n_nodes, 0);
  out.gather_index.resize(nodes.size());
  for (size_t t = 0; t < nodes.size(); ++t) out.gather_index[t] = packed[nodes[t]];
  for (int64_t b = 0; b < s.num; ++b) {
    const int64_t a = s.cu[b], e = s.cu[b + 1];
    for (int64_t t = a + 1; t < e; ++t) {
      if (!s.trained[t]) continue;
      const int64_t q = out.gather_index[t - 1];
      int64_t& label = out.shift_labels[q];
      if (!conflict[q]) {
        if (label == kIgnore) {
          label = s.ids[t];
        } else if (label != s.ids[t]) {
          label = kIgnore;
          conflict[q] = 1;
        }
      }
      out.token_index.push_back(q);
      out.target_ids.push_back(s.ids[t]);
      out.token_pos.push_back(t - a);
      out.segment_id.push_back(b);
      out.target_src.push_back(s.base + t);
    }
    TORCH_CHECK(out.token_index.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "pack_prefix_tree: a row has more than 2^31 - 1 targets");
    out.cu_seqlens.push_back(static_cast<int32_t>(out.token_index.size()));
  }
  out.load = load;
  return out;
}

namespace {

void build_row(Trie& trie, const Samples& s, const int64_t* group) {
  for (int64_t b = 0; b < s.num; ++b)
    trie.add(s.ids + s.cu[b], s.trained + s.cu[b], s.cu[b + 1] - s.cu[b], group ? group[b] : -1);
}

template <typename T>
T* fill(T* dst, const std::vector<T>& src) {
  return std::copy(src.begin(), src.end(), dst);
}

std::vector<torch::Tensor> concat(const std::vector<RowLayout>& rows, int64_t total_tokens) {
  const int64_t R = static_cast<int64_t>(rows.size());
  int64_t N = 0, S = 0, K = 0, M = 0, B = 0;
  for (const RowLayout& r : rows) {
    N += r.input_ids.size();
    S += r.parent.size();
    K += r.kv_index.size();
    M += r.token_index.size();
    B += r.cu_seqlens.size() - 1;
  }
  const auto i64 = torch::dtype(torch::kInt64);
  const auto i32 = torch::dtype(torch::kInt32);
  std::vector<torch::Tensor> out = {
      torch::empty({N}, i64),     torch::empty({N}, i64), torch::empty({N}, i64), torch::empty({N}, i32),
      torch::empty({S + R}, i32), torch::empty({S}, i32), torch::empty({K}, i64), torch::empty({S + R}, i32),
      torch::empty({total_tokens}, i64), torch::empty({M}, i64), torch::empty({M}, i64), torch::empty({M}, i64),
      torch::empty({M}, i64),     torch::empty({M}, i64), torch::empty({B + R}, i32), torch::empty({R, 7}, i64)};
  int64_t* sizes = out[15].data_ptr<int64_t>();
  // Per-row output offsets, then parallel copies into disjoint ranges.
  std::vector<int64_t> off_n(R + 1, 0), off_s(R + 1, 0), off_k(R + 1, 0), off_m(R + 1, 0), off_b(R + 1, 0),
      off_t(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    const RowLayout& w = rows[r];
    off_n[r + 1] = off_n[r] + w.input_ids.size();
    off_s[r + 1] = off_s[r] + w.parent.size();
    off_k[r + 1] = off_k[r] + w.kv_index.size();
    off_m[r + 1] = off_m[r] + w.token_index.size();
    off_b[r + 1] = off_b[r] + w.cu_seqlens.size();
    off_t[r + 1] = off_t[r] + w.gather_index.size();
    int64_t* z = sizes + 7 * r;
    z[0] = w.input_ids.size();
    z[1] = w.parent.size();
    z[2] = w.kv_index.size();
    z[3] = w.token_index.size();
    z[4] = w.load;
    z[5] = w.max_q;
    z[6] = w.max_k;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < R; ++r) {
    const RowLayout& w = rows[r];
    fill(out[0].data_ptr<int64_t>() + off_n[r], w.input_ids);
    fill(out[1].data_ptr<int64_t>() + off_n[r], w.position_ids);
    fill(out[2].data_ptr<int64_t>() + off_n[r], w.shift_labels);
    fill(out[3].data_ptr<int32_t>() + off_n[r], w.leave);
    fill(out[4].data_ptr<int32_t>() + off_s[r] + r, w.cu_q);
    fill(out[5].data_ptr<int32_t>() + off_s[r], w.parent);
    fill(out[6].data_ptr<int64_t>() + off_k[r], w.kv_index);
    fill(out[7].data_ptr<int32_t>() + off_s[r] + r, w.cu_k);
    fill(out[8].data_ptr<int64_t>() + off_t[r], w.gather_index);
    fill(out[9].data_ptr<int64_t>() + off_m[r], w.token_index);
    fill(out[10].data_ptr<int64_t>() + off_m[r], w.target_ids);
    fill(out[11].data_ptr<int64_t>() + off_m[r], w.token_pos);
    fill(out[12].data_ptr<int64_t>() + off_m[r], w.segment_id);
    fill(out[13].data_ptr<int64_t>() + off_m[r], w.target_src);
    fill(out[14].data_ptr<int32_t>() + off_b[r], w.cu_seqlens);
  }
  return out;
}

// Every input is checked here too: the registered op is reachable without the Python validation.
void check_inputs(const torch::Tensor& tokens, const torch::Tensor& cu_tokens, const torch::Tensor& trained,
                  const torch::Tensor& group, const torch::Tensor& row_cu) {
  const char* op = "prefix_tree_build";
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(), op,
              ": tokens must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(trained.dim() == 1 && trained.scalar_type() == torch::kBool && trained.is_contiguous() &&
                  trained.numel() == tokens.numel(),
              op, ": trained must be a contiguous bool tensor shaped like tokens");
  TORCH_CHECK(cu_tokens.dim() == 1 && cu_tokens.numel() >= 1 && cu_tokens.scalar_type() == torch::kInt64 &&
                  cu_tokens.is_contiguous(),
              op, ": cu_tokens must be a contiguous 1-D int64 tensor of B + 1 >= 1 offsets");
  const int64_t B = cu_tokens.numel() - 1, T = tokens.numel();
  const int64_t* cu = cu_tokens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, op, ": cu_tokens must start at 0 and end at the token count");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], op, ": cu_tokens must be non-decreasing");
  const int64_t* ids = tokens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ids[t] >= 0, op, ": tokens must be non-negative");
  TORCH_CHECK(group.dim() == 1 && group.scalar_type() == torch::kInt64 && group.is_contiguous() &&
                  (group.numel() == 0 || group.numel() == B),
              op, ": group must be a contiguous int64 tensor of B entries, or empty");
  for (int64_t b = 0; b < group.numel(); ++b)
    TORCH_CHECK(group.data_ptr<int64_t>()[b] >= 0, op, ": group must be non-negative");
  TORCH_CHECK(row_cu.dim() == 1 && row_cu.numel() >= 1 && row_cu.scalar_type() == torch::kInt64 &&
                  row_cu.is_contiguous(),
              op, ": row_cu must be a contiguous 1-D int64 tensor of R + 1 >= 1 offsets");
  const int64_t R = row_cu.numel() - 1;
  const int64_t* rc = row_cu.data_ptr<int64_t>();
  TORCH_CHECK(rc[0] == 0 && rc[R] == B, op, ": row_cu must start at 0 and end at the sample count");
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rc[r] <= rc[r + 1], op, ": row_cu must be non-decreasing");
}

}  // namespace

std::vector<torch::Tensor> prefix_tree_build_cpu(const torch::Tensor& tokens, const torch::Tensor& cu_tokens,
                                                 const torch::Tensor& trained, const torch::Tensor& group,
                                                 const torch::Tensor& row_cu, bool next_key) {
  check_inputs(tokens, cu_tokens, trained, group, row_cu);
  const int64_t R = row_cu.numel() - 1;
  const int64_t* rc = row_cu.data_ptr<int64_t>();
  const int64_t* cu = cu_tokens.data_ptr<int64_t>();
  const int64_t* ids = tokens.data_ptr<int64_t>();
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(trained.data_ptr<bool>());
  const int64_t* grp = group.numel() ? group.data_ptr<int64_t>() : nullptr;
  std::vector<RowLayout> rows(R);
  // Offsets relative to the row's first token so each row's layout is self-contained.
  std::vector<std::vector<int64_t>> row_offsets(R);
  std::exception_ptr error = nullptr;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < R; ++r) {
    try {
      std::vector<int64_t>& off = row_offsets[r];
      const int64_t first = cu[rc[r]];
      for (int64_t b = rc[r]; b <= rc[r + 1]; ++b) off.push_back(cu[b] - first);
      const Samples s{ids + first, mask + first, off.data(), rc[r + 1] - rc[r], first};
      Trie trie(next_key);
      build_row(trie, s, grp ? grp + rc[r] : nullptr);
      rows[r] = trie.layout(s);
      // gather_index of the row's tokens are row-local positions already.
    } catch (...) {
#pragma omp critical
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return concat(rows, tokens.numel());
}

PrefixTrie::PrefixTrie(bool next_key) : trie_(new Trie(next_key)), next_key_(next_key) {}
PrefixTrie::~PrefixTrie() { delete trie_; }

namespace {
torch::Tensor ids_of(const torch::Tensor& ids, const char* what) {
  TORCH_CHECK(ids.dim() == 1 && !ids.is_floating_point() && !ids.is_complex() && ids.scalar_type() != torch::kBool,
              "PrefixTrie.", what, ": ids must be a 1-D integer tensor");
  torch::Tensor t = ids.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) TORCH_CHECK(p[i] >= 0, "PrefixTrie.", what, ": ids must be non-negative");
  return t;
}
}  // namespace

int64_t PrefixTrie::match(const torch::Tensor& ids, int64_t group) const {
  const torch::Tensor t = ids_of(ids, "match");
  return trie_->match(t.data_ptr<int64_t>(), t.numel(), group);
}

void PrefixTrie::add(const torch::Tensor& ids, const torch::Tensor& trained, int64_t group) {
  const torch::Tensor t = ids_of(ids, "add");
  TORCH_CHECK(trained.dim() == 1 && trained.numel() == t.numel(),
              "PrefixTrie.add: trained must be a 1-D mask shaped like ids");
  const torch::Tensor m = trained.to(torch::kCPU).ne(0).contiguous();
  const int64_t* p = t.data_ptr<int64_t>();
  const uint8_t* q = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
  trie_->add(p, q, t.numel(), group);
  tokens_.insert(tokens_.end(), p, p + t.numel());
  trained_.insert(trained_.end(), q, q + t.numel());
  cu_.push_back(static_cast<int64_t>(tokens_.size()));
}

int64_t PrefixTrie::num_nodes() const { return static_cast<int64_t>(trie_->tok.size()); }
int64_t PrefixTrie::num_samples() const { return static_cast<int64_t>(cu_.size()) - 1; }
int64_t PrefixTrie::load() const { return trie_->load; }
int64_t PrefixTrie::trained() const { return trie_->trained; }

torch::Tensor PrefixTrie::node_tokens() const {
  return torch::tensor(trie_->tok, torch::dtype(torch::kInt64));
}

std::vector<torch::Tensor> PrefixTrie::layout() const {
  const Samples s{tokens_.data(), trained_.data(), cu_.data(), num_samples(), 0};
  std::vector<RowLayout> rows;
  rows.push_back(trie_->layout(s));
  return concat(rows, static_cast<int64_t>(tokens_.size()));
}

}  // namespace rlvr
