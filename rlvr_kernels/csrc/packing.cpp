// Prefix-tree packing: the trie (an open-addressing hash on (parent, token, next)) and TRL's layout.
//
// Outputs of prefix_tree_build_cpu, each the rows' parts laid end to end (N forwarded tokens, S
// segments, K gathered K/V rows, M targets, B samples of a row; indices are row-local):
// The N-sized outputs (0-3) have room for every token: row r's N nodes start at its first token.
//   0 input_ids [N] i64       1 position_ids [N] i64      2 shift_labels [N] i64 (-100: untrained,
//                                                           or several different targets)
//   3 leave [N] i32 (end of the node's subtree in packed order; enter is the packed position)
//   4 cu_seqlens_q [S+1] i32  5 segment_parent [S] i32 (-1: a root)
//   6 kv_index [K] i64        7 cu_seqlens_k [S+1] i32
//   8 gather_index [T] i64 (packed position of every input token, in input order)
//   9 token_index [M] i64    10 target_ids [M] i64      11 token_pos [M] i64 (position in its sample)
//  12 segment_id [M] i64 (sample within the row)
//  13 cu_seqlens [B+1] i32 (targets per sample)         14 row_sizes [R, 8] i64:
//                       N, S, K, M, load, longest segment, longest path, the row's first token offset
//  15 token values [M, C] f32 (empty without token_values)
//  16 sample values [M, C'] f32 (empty without sample_values)
#include "packing.h"

#include "alloc.h"


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

// Where a row's per-token and per-target outputs go: written in place (the N-sized arrays have room
// for the row's T tokens, N <= T), so the large arrays are touched once. The segment table's size
// is known only after the walk, so it comes back in vectors.
struct RowOut {
  int64_t *input_ids, *position_ids, *shift_labels, *gather_index;
  int32_t* leave;
  int64_t *token_index, *target_ids, *token_pos, *segment_id;
  int32_t* cu_seqlens;
};

struct RowLayout {
  std::vector<int64_t> kv_index;
  std::vector<int32_t> cu_q{0}, parent, cu_k{0};
  int64_t num_nodes = 0, num_targets = 0, load = 0, max_q = 0, max_k = 0, first_token = 0;
};

// A row's samples: sample b's tokens and trained flags at ids[b], trained[b]; cu [num + 1] its
// offsets in the row's token order (the order the trie added them in).
struct Samples {
  const int64_t* const* ids;
  const uint8_t* const* trained;
  const int64_t* cu;
  int64_t num;
};

}  // namespace

struct Trie {
  explicit Trie(bool next_key) : next_key(next_key) {}

  // Children are found by scanning a node's child list while it has at most kScan children (the
  // common case: chains and small forks, whose nodes sit next to each other in memory), through
  // the hash table beyond that and for roots, so a wide fork costs no more than a hash probe.
  static constexpr int32_t kScan = 4;

  bool next_key;
  std::vector<int64_t> tok, nxt;        // node -> its token, and the next-token part of its key
  std::vector<int32_t> first_child, last_child, next_sibling, num_children;
  std::vector<uint8_t> ends;            // a sample ends on this node
  int32_t first_root = -1, last_root = -1;
  std::vector<int32_t> nodes;           // node of every added token, in order
  ChildTable table;
  int64_t load = 0, trained = 0;

  void reserve(size_t n) {
    for (auto* v : {&tok, &nxt}) v->reserve(n);
    for (auto* v : {&first_child, &last_child, &next_sibling, &num_children}) v->reserve(n);
    ends.reserve(n);
    nodes.reserve(n);
  }

  int64_t next_of(const int64_t* ids, int64_t n, int64_t p) const {
    return next_key ? (p + 1 < n ? ids[p + 1] : kEnd) : 0;
  }
  static int64_t root_key(int64_t group) { return group < 0 ? -1 : -2 - group; }

  // The child of `parent` (-1: the roots under root key `rkey`) keyed (t, n), or -1.
  int32_t find(int32_t parent, int64_t rkey, int64_t t, int64_t n) const {
    if (parent >= 0 && num_children[parent] <= kScan) {
      for (int32_t c = first_child[parent]; c >= 0; c = next_sibling[c])
        if (tok[c] == t && nxt[c] == n) return c;
      return -1;
    }
    return table.find(parent >= 0 ? parent : rkey, t, n);
  }

  int32_t make(int32_t parent, int64_t rkey, int64_t t, int64_t n) {
    TORCH_CHECK(tok.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "pack_prefix_tree: a row holds more than 2^31 - 1 unique tokens");
    const int32_t child = static_cast<int32_t>(tok.size());
    tok.push_back(t);
    nxt.push_back(n);
    first_child.push_back(-1);
    last_child.push_back(-1);
    next_sibling.push_back(-1);
    num_children.push_back(0);
    ends.push_back(0);
    if (parent < 0) {
      (last_root < 0 ? first_root : next_sibling[last_root]) = child;
      last_root = child;
      table.insert(rkey, t, n, child);
      return child;
    }
    (last_child[parent] < 0 ? first_child[parent] : next_sibling[last_child[parent]]) = child;
    last_child[parent] = child;
    const int32_t count = ++num_children[parent];
    if (count == kScan + 1) {  // outgrew the scan: index every child
      for (int32_t c = first_child[parent]; c >= 0; c = next_sibling[c]) table.insert(parent, tok[c], nxt[c], c);
    } else if (count > kScan + 1) {
      table.insert(parent, t, n, child);
    }
    return child;
  }

  int64_t match(const int64_t* ids, int64_t n, int64_t group) const {
    const int64_t rkey = root_key(group);
    int32_t parent = -1;
    for (int64_t p = 0; p < n; ++p) {
      const int32_t child = find(parent, rkey, ids[p], next_of(ids, n, p));
      if (child < 0) return p;
      parent = child;
    }
    return n;
  }

  void add(const int64_t* ids, const uint8_t* mask, int64_t n, int64_t group) {
    const int64_t rkey = root_key(group);
    int32_t parent = -1;
    bool fresh = false;  // a node made by this sample has no children yet: no lookup needed
    for (int64_t p = 0; p < n; ++p) {
      const int64_t next = next_of(ids, n, p);
      int32_t child = fresh ? -1 : find(parent, rkey, ids[p], next);
      if (child < 0) {
        child = make(parent, rkey, ids[p], next);
        load += p + 1;
        fresh = true;
      }
      nodes.push_back(child);
      parent = child;
    }
    if (n > 0) ends[parent] = 1;
    for (int64_t p = 0; p < n; ++p) trained += mask[p] != 0;
  }

  RowLayout layout(const Samples& s, const RowOut& o) const;
};

namespace {

struct Frame {
  int32_t node, parent_segment, depth;
};

}  // namespace

// DFS pre-order over segments (children in insertion order), then the loss terms of every sample.
RowLayout Trie::layout(const Samples& s, const RowOut& o) const {
  RowLayout out;
  const int64_t n_nodes = static_cast<int64_t>(tok.size());
  std::vector<int32_t> packed(n_nodes), segment_of(n_nodes);
  std::vector<Frame> stack;
  auto push_children = [&](int32_t first, int32_t segment, int32_t depth) {
    const size_t mark = stack.size();
    for (int32_t c = first; c >= 0; c = next_sibling[c]) stack.push_back({c, segment, depth});
    std::reverse(stack.begin() + mark, stack.end());  // popped in insertion order
  };
  push_children(first_root, -1, 0);
  int64_t pos = 0;
  while (!stack.empty()) {
    Frame f = stack.back();
    stack.pop_back();
    const int32_t segment = static_cast<int32_t>(out.parent.size());
    const int64_t start = pos;
    int32_t node = f.node, depth = f.depth;
    while (true) {
      packed[node] = static_cast<int32_t>(pos);
      segment_of[node] = segment;
      o.input_ids[pos] = tok[node];
      o.position_ids[pos++] = depth++;
      if (num_children[node] != 1 || ends[node]) break;
      node = first_child[node];
    }
    out.cu_q.push_back(static_cast<int32_t>(pos));
    out.parent.push_back(f.parent_segment);
    if (f.parent_segment >= 0) {  // the parent's path, then this segment
      const int64_t a = out.cu_k[f.parent_segment], b = out.cu_k[f.parent_segment + 1];
      for (int64_t i = a; i < b; ++i) out.kv_index.push_back(out.kv_index[i]);
    }
    for (int64_t i = start; i < pos; ++i) out.kv_index.push_back(i);
    TORCH_CHECK(out.kv_index.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "pack_prefix_tree: the gathered K/V index of a row exceeds 2^31 - 1 entries (TRL's int32 "
                "tree_cu_seqlens_k); split the row");
    out.cu_k.push_back(static_cast<int32_t>(out.kv_index.size()));
    out.max_q = std::max(out.max_q, pos - start);
    out.max_k = std::max<int64_t>(out.max_k, out.cu_k[segment + 1] - out.cu_k[segment]);
    push_children(first_child[node], segment, depth);
  }
  out.num_nodes = n_nodes;

  // A segment's subtree ends where its last descendant ends; children come after their parent.
  const int64_t n_seg = static_cast<int64_t>(out.parent.size());
  std::vector<int32_t> subtree_end(out.cu_q.begin() + 1, out.cu_q.end());
  for (int64_t g = n_seg - 1; g >= 0; --g)
    if (out.parent[g] >= 0) subtree_end[out.parent[g]] = std::max(subtree_end[out.parent[g]], subtree_end[g]);
  for (int64_t i = 0; i < n_nodes; ++i) o.leave[packed[i]] = subtree_end[segment_of[i]];

  // Loss terms, sample-major: a trained token p >= 1 is predicted by the node of token p - 1.
  std::fill(o.shift_labels, o.shift_labels + n_nodes, kIgnore);
  std::vector<uint8_t> conflict(n_nodes, 0);
  for (size_t t = 0; t < nodes.size(); ++t) o.gather_index[t] = packed[nodes[t]];
  int64_t m = 0;
  o.cu_seqlens[0] = 0;
  for (int64_t b = 0; b < s.num; ++b) {
    const int64_t a = s.cu[b], n = s.cu[b + 1] - a;
    const int64_t* ids = s.ids[b];
    const uint8_t* trained = s.trained[b];
    for (int64_t p = 1; p < n; ++p) {
      if (!trained[p]) continue;
      const int64_t q = o.gather_index[a + p - 1];
      int64_t& label = o.shift_labels[q];
      if (!conflict[q]) {
        if (label == kIgnore) {
          label = ids[p];
        } else if (label != ids[p]) {
          label = kIgnore;
          conflict[q] = 1;
        }
      }
      o.token_index[m] = q;
      o.target_ids[m] = ids[p];
      o.token_pos[m] = p;
      o.segment_id[m++] = b;
    }
    o.cu_seqlens[b + 1] = static_cast<int32_t>(m);
  }
  out.num_targets = m;
  out.load = load;
  return out;
}

namespace {

void build_row(Trie& trie, const Samples& s, const int64_t* group, const int64_t* order) {
  for (int64_t b = 0; b < s.num; ++b)
    trie.add(s.ids[b], s.trained[b], s.cu[b + 1] - s.cu[b], group ? group[order[b]] : -1);
}

template <typename T>
T* fill(T* dst, const std::vector<T>& src) {
  return std::copy(src.begin(), src.end(), dst);
}

// Targets (trained tokens after a sample's first) of each sample range, to place the rows' outputs.
int64_t count_targets(const Samples& s) {
  int64_t m = 0;
  for (int64_t b = 0; b < s.num; ++b)
    for (int64_t p = 1; p < s.cu[b + 1] - s.cu[b]; ++p) m += s.trained[b][p] != 0;
  return m;
}

// The output tensors for rows of T tokens, B samples and M targets in all (the N-sized ones with
// room for T: a row's nodes start at its first token's offset).
std::vector<torch::Tensor> allocate(int64_t T, int64_t B, int64_t M, int64_t R) {
  const auto i64 = torch::kInt64;
  const auto i32 = torch::kInt32;
  // The large ones from the huge-page cache (alloc.h): a row of a million tokens writes ~100 MB,
  // whose first-touch page faults cost more than the build on fresh memory.
  return {empty_output({T}, i64),  empty_output({T}, i64),  empty_output({T}, i64),      empty_output({T}, i32),
          torch::Tensor(),         torch::Tensor(),         torch::Tensor(),             torch::Tensor(),
          empty_output({T}, i64),  empty_output({M}, i64),  empty_output({M}, i64),      empty_output({M}, i64),
          empty_output({M}, i64),  empty_output({B + R}, i32), torch::empty({R, 8}, torch::kInt64)};
}

RowOut row_out(std::vector<torch::Tensor>& out, int64_t t0, int64_t m0, int64_t b0) {
  return {out[0].data_ptr<int64_t>() + t0,  out[1].data_ptr<int64_t>() + t0,  out[2].data_ptr<int64_t>() + t0,
          out[8].data_ptr<int64_t>() + t0,  out[3].data_ptr<int32_t>() + t0,  out[9].data_ptr<int64_t>() + m0,
          out[10].data_ptr<int64_t>() + m0, out[11].data_ptr<int64_t>() + m0, out[12].data_ptr<int64_t>() + m0,
          out[13].data_ptr<int32_t>() + b0};
}

// The segment tables (outputs 4-7) of the rows laid end to end, and the row sizes (output 14).
void finish(std::vector<torch::Tensor>& out, const std::vector<RowLayout>& rows) {
  const int64_t R = static_cast<int64_t>(rows.size());
  std::vector<int64_t> off_s(R + 1, 0), off_k(R + 1, 0);
  int64_t* sizes = out[14].data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const RowLayout& w = rows[r];
    off_s[r + 1] = off_s[r] + w.parent.size();
    off_k[r + 1] = off_k[r] + w.kv_index.size();
    int64_t* z = sizes + 8 * r;
    z[0] = w.num_nodes;
    z[1] = w.parent.size();
    z[2] = w.kv_index.size();
    z[3] = w.num_targets;
    z[4] = w.load;
    z[5] = w.max_q;
    z[6] = w.max_k;
    z[7] = w.first_token;
  }
  const int64_t S = off_s[R], K = off_k[R];
  out[4] = empty_output({S + R}, torch::kInt32);
  out[5] = empty_output({S}, torch::kInt32);
  out[6] = empty_output({K}, torch::kInt64);
  out[7] = empty_output({S + R}, torch::kInt32);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < R; ++r) {
    const RowLayout& w = rows[r];
    fill(out[4].data_ptr<int32_t>() + off_s[r] + r, w.cu_q);
    fill(out[5].data_ptr<int32_t>() + off_s[r], w.parent);
    fill(out[6].data_ptr<int64_t>() + off_k[r], w.kv_index);
    fill(out[7].data_ptr<int32_t>() + off_s[r] + r, w.cu_k);
  }
}

// Every input is checked here too: the registered op is reachable without the Python validation.
void check_inputs(const torch::Tensor& tokens, const torch::Tensor& cu_tokens, const torch::Tensor& trained,
                  const torch::Tensor& group, const torch::Tensor& order, const torch::Tensor& row_cu) {
  const char* op = "prefix_tree_build";
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(), op,
              ": tokens must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(cu_tokens.dim() == 1 && cu_tokens.numel() >= 1 && cu_tokens.scalar_type() == torch::kInt64 &&
                  cu_tokens.is_contiguous(),
              op, ": cu_tokens must be a contiguous 1-D int64 tensor of B + 1 >= 1 offsets");
  const int64_t B = cu_tokens.numel() - 1, T = tokens.numel();
  const int64_t* cu = cu_tokens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, op, ": cu_tokens must start at 0 and end at the token count");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], op, ": cu_tokens must be non-decreasing");
  const bool per_token = trained.scalar_type() == torch::kBool;
  TORCH_CHECK(trained.dim() == 1 && trained.is_contiguous() && (per_token || trained.scalar_type() == torch::kInt64) &&
                  trained.numel() == (per_token ? T : B),
              op, ": trained must be a contiguous bool mask [T] or the int64 first trained position of each sample [B]");
  if (!per_token) {
    const int64_t* start = trained.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(start[b] >= 0 && start[b] <= cu[b + 1] - cu[b], op, ": trained start out of its sample's range");
  }
  const int64_t* ids = tokens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ids[t] >= 0, op, ": tokens must be non-negative");
  TORCH_CHECK(group.dim() == 1 && group.scalar_type() == torch::kInt64 && group.is_contiguous() &&
                  (group.numel() == 0 || group.numel() == B),
              op, ": group must be a contiguous int64 tensor of B entries, or empty");
  for (int64_t b = 0; b < group.numel(); ++b)
    TORCH_CHECK(group.data_ptr<int64_t>()[b] >= 0, op, ": group must be non-negative");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == torch::kInt64 && order.is_contiguous(), op,
              ": order must be a contiguous 1-D int64 tensor of sample indices");
  for (int64_t i = 0; i < order.numel(); ++i) {
    const int64_t b = order.data_ptr<int64_t>()[i];
    TORCH_CHECK(b >= 0 && b < B, op, ": order holds a sample index out of range");
  }
  TORCH_CHECK(row_cu.dim() == 1 && row_cu.numel() >= 1 && row_cu.scalar_type() == torch::kInt64 &&
                  row_cu.is_contiguous(),
              op, ": row_cu must be a contiguous 1-D int64 tensor of R + 1 >= 1 offsets");
  const int64_t R = row_cu.numel() - 1;
  const int64_t* rc = row_cu.data_ptr<int64_t>();
  TORCH_CHECK(rc[0] == 0 && rc[R] == order.numel(), op, ": row_cu must start at 0 and end at the length of order");
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rc[r] <= rc[r + 1], op, ": row_cu must be non-decreasing");
}

}  // namespace

std::vector<torch::Tensor> prefix_tree_build_cpu(const torch::Tensor& tokens, const torch::Tensor& cu_tokens,
                                                 const torch::Tensor& trained, const torch::Tensor& group,
                                                 const torch::Tensor& order, const torch::Tensor& row_cu,
                                                 const std::optional<torch::Tensor>& token_values,
                                                 const std::optional<torch::Tensor>& sample_values, bool next_key) {
  check_inputs(tokens, cu_tokens, trained, group, order, row_cu);
  auto check_values = [&](const std::optional<torch::Tensor>& v, int64_t rows, const char* name) {
    TORCH_CHECK(!v || (v->dim() == 2 && v->scalar_type() == torch::kFloat32 && v->is_contiguous() &&
                       v->size(0) == rows),
                "prefix_tree_build: ", name, " must be a contiguous float32 [", rows, ", C] tensor");
  };
  check_values(token_values, tokens.numel(), "token_values");
  check_values(sample_values, cu_tokens.numel() - 1, "sample_values");
  const int64_t R = row_cu.numel() - 1;
  const int64_t* rc = row_cu.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* cu = cu_tokens.data_ptr<int64_t>();
  const int64_t* ids = tokens.data_ptr<int64_t>();
  // The trained tokens come as a mask, or as each sample's first trained position (no [T] mask to
  // build in Python for the common prompt + completion layout).
  const bool per_token = trained.scalar_type() == torch::kBool;
  const uint8_t* mask = per_token ? reinterpret_cast<const uint8_t*>(trained.data_ptr<bool>()) : nullptr;
  const int64_t* start = per_token ? nullptr : trained.data_ptr<int64_t>();
  const int64_t* grp = group.numel() ? group.data_ptr<int64_t>() : nullptr;
  const int64_t B = order.numel();
  auto length = [&](int64_t i) { return cu[ord[i] + 1] - cu[ord[i]]; };

  // Where each row's tokens and targets go: count them first (the same rule as Trie::layout).
  std::vector<int64_t> t_off(R + 1, 0), m_off(R + 1, 0);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    int64_t t = 0, m = 0;
    for (int64_t i = rc[r]; i < rc[r + 1]; ++i) {
      const int64_t b = ord[i], n = length(i);
      t += n;
      if (per_token) {
        for (int64_t p = 1; p < n; ++p) m += mask[cu[b] + p] != 0;
      } else {
        m += std::max<int64_t>(0, n - std::max<int64_t>(start[b], 1));
      }
    }
    t_off[r + 1] = t;
    m_off[r + 1] = m;
  }
  for (int64_t r = 0; r < R; ++r) {
    t_off[r + 1] += t_off[r];
    m_off[r + 1] += m_off[r];
  }
  std::vector<torch::Tensor> out = allocate(t_off[R], B, m_off[R], R);

  std::vector<RowLayout> rows(R);
  std::exception_ptr error = nullptr;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < R; ++r) {
    try {
      const int64_t nb = rc[r + 1] - rc[r];
      std::vector<int64_t> off(nb + 1, 0);
      std::vector<const int64_t*> sid(nb);
      std::vector<const uint8_t*> str(nb);
      for (int64_t j = 0; j < nb; ++j) off[j + 1] = off[j] + length(rc[r] + j);
      std::vector<uint8_t> local;
      if (!per_token) local.assign(off[nb], 0);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t b = ord[rc[r] + j];
        sid[j] = ids + cu[b];
        if (per_token) {
          str[j] = mask + cu[b];
        } else {
          std::fill(local.begin() + off[j] + start[b], local.begin() + off[j + 1], 1);
          str[j] = local.data() + off[j];
        }
      }
      const Samples s{sid.data(), str.data(), off.data(), nb};
      Trie trie(next_key);
      trie.reserve(static_cast<size_t>(off[nb]));
      build_row(trie, s, grp, ord + rc[r]);
      rows[r] = trie.layout(s, row_out(out, t_off[r], m_off[r], rc[r] + r));
      rows[r].first_token = t_off[r];
    } catch (...) {
#pragma omp critical
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  finish(out, rows);

  // Values carried to the targets (old log-probs, advantages): [M, C] float32 each, gathered at
  // the target's token (token_values) or its sample (sample_values).
  const int64_t M = m_off[R];
  const int64_t ct = token_values ? token_values->size(1) : 0, cs = sample_values ? sample_values->size(1) : 0;
  out.push_back(empty_output({token_values ? M : 0, ct}, torch::kFloat32));
  out.push_back(empty_output({sample_values ? M : 0, cs}, torch::kFloat32));
  if (token_values || sample_values) {
    const float* tv = token_values ? token_values->data_ptr<float>() : nullptr;
    const float* sv = sample_values ? sample_values->data_ptr<float>() : nullptr;
    float* to = out[15].data_ptr<float>();
    float* so = out[16].data_ptr<float>();
    const int64_t* seg = out[12].data_ptr<int64_t>();
    const int64_t* tpos = out[11].data_ptr<int64_t>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t m = m_off[r]; m < m_off[r + 1]; ++m) {
        const int64_t b = ord[rc[r] + seg[m]];
        if (tv) std::copy(tv + (cu[b] + tpos[m]) * ct, tv + (cu[b] + tpos[m] + 1) * ct, to + m * ct);
        if (sv) std::copy(sv + b * cs, sv + (b + 1) * cs, so + m * cs);
      }
    }
  }
  return out;
}

PrefixTrie::PrefixTrie(bool next_key) : trie_(new Trie(next_key)) {}
PrefixTrie::~PrefixTrie() { delete trie_; }

int64_t PrefixTrie::match(const int64_t* ids, int64_t n, int64_t group) const {
  return trie_->match(ids, n, group);
}

void PrefixTrie::add(const int64_t* ids, const uint8_t* trained, int64_t n, int64_t group) {
  trie_->add(ids, trained, n, group);
  tokens_.insert(tokens_.end(), ids, ids + n);
  trained_.insert(trained_.end(), trained, trained + n);
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
  const int64_t nb = num_samples();
  std::vector<const int64_t*> sid(nb);
  std::vector<const uint8_t*> str(nb);
  for (int64_t b = 0; b < nb; ++b) {
    sid[b] = tokens_.data() + cu_[b];
    str[b] = trained_.data() + cu_[b];
  }
  const Samples s{sid.data(), str.data(), cu_.data(), nb};
  std::vector<torch::Tensor> out =
      allocate(static_cast<int64_t>(tokens_.size()), num_samples(), count_targets(s), /*R=*/1);
  std::vector<RowLayout> rows;
  rows.push_back(trie_->layout(s, row_out(out, 0, 0, 0)));
  finish(out, rows);
  return out;
}

}  // namespace rlvr
