// The only translation unit that includes torch/extension.h: Python bindings
// of the flatshard runtime as `flatshard._C`. Bindings that can block release
// the GIL.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "flatshard/collectives.h"
#include "flatshard/flat_param.h"
#include "flatshard/layout.h"
#include "flatshard/rate_limiter.h"
#include "flatshard/scheduler.h"

namespace py = pybind11;
using flatshard::FlatParamHandle;
using flatshard::FlatParamLayout;
using flatshard::Scheduler;

namespace {

// None (a parameter that got no gradient) becomes an undefined tensor: zeros.
std::vector<at::Tensor> undefined_for_none(const std::vector<std::optional<at::Tensor>>& grads) {
  std::vector<at::Tensor> out;
  out.reserve(grads.size());
  for (const auto& g : grads) out.push_back(g.has_value() ? *g : at::Tensor());
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flatshard runtime: flat parameter layout and storage, collective scheduler";

  py::enum_<flatshard::LayoutKind>(m, "LayoutKind")
      .value("FLAT", flatshard::LayoutKind::kFlat)
      .value("DIM0", flatshard::LayoutKind::kDim0);

  py::class_<FlatParamLayout>(m, "FlatParamLayout",
                              "Offsets, padding and shard ranges of one unit's flat parameter "
                              "(see [Note: Flat parameter layout] and [Note: Dim-0 layout] in "
                              "csrc/flatshard/layout.h).")
      .def(py::init<std::vector<std::vector<std::int64_t>>, std::int64_t, std::int64_t>(),
           py::arg("shapes"), py::arg("shard_factor"), py::arg("alignment") = 1)
      .def_static("dim0", &FlatParamLayout::dim0, py::arg("shapes"), py::arg("shard_factor"),
                  py::arg("shard_dims") = std::vector<std::int64_t>{},
                  "FSDP2's layout: each parameter chunked on dim 0 as torch.chunk cuts it (or on its shard dim: "
                  "see [Note: Sharding on another dim] in layout.h).")
      .def_property_readonly("shard_dims", &FlatParamLayout::shard_dims)
      .def_property_readonly("kind", &FlatParamLayout::kind)
      .def("rows_per_shard", &FlatParamLayout::rows_per_shard, py::arg("index"))
      .def("row_numel", &FlatParamLayout::row_numel, py::arg("index"))
      .def("rows_of_rank", &FlatParamLayout::rows_of_rank, py::arg("index"), py::arg("rank"))
      .def_property_readonly("num_params", &FlatParamLayout::num_params)
      .def_property_readonly("shapes", &FlatParamLayout::shapes)
      .def_property_readonly("numels", &FlatParamLayout::numels)
      .def_property_readonly("offsets", &FlatParamLayout::offsets)
      .def_property_readonly("shard_factor", &FlatParamLayout::shard_factor)
      .def_property_readonly("alignment", &FlatParamLayout::alignment)
      .def_property_readonly("unpadded_numel", &FlatParamLayout::unpadded_numel)
      .def_property_readonly("padded_numel", &FlatParamLayout::padded_numel)
      .def_property_readonly("padding_numel", &FlatParamLayout::padding_numel)
      .def_property_readonly("total_padding_numel", &FlatParamLayout::total_padding_numel)
      .def_property_readonly("shard_numel", &FlatParamLayout::shard_numel)
      .def("shard_range", &FlatParamLayout::shard_range, py::arg("rank"))
      .def(
          "shard_slices",
          [](const FlatParamLayout& self, std::int64_t rank) {
            std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>> out;
            for (const auto& s : self.shard_slices(rank)) {
              out.emplace_back(s.param_index, s.offset_in_param, s.offset_in_shard, s.numel);
            }
            return out;
          },
          py::arg("rank"),
          "[(param_index, offset_in_param, offset_in_shard, numel)] for rank's shard");

  m.def(
      "flatten",
      [](const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout) {
        TORCH_CHECK(!tensors.empty(), "flatshard.flatten: expected at least one tensor");
        return FlatParamHandle::flatten(tensors, layout, tensors.front().options());
      },
      py::arg("tensors"), py::arg("layout"));
  m.def("views_of", &FlatParamHandle::views_of, py::arg("flat"), py::arg("layout"));
  m.def("alias_with_own_storage", &FlatParamHandle::alias_with_own_storage, py::arg("view"));

  py::enum_<flatshard::ShardedState>(m, "ShardedState")
      .value("SHARDED", flatshard::ShardedState::kSharded)
      .value("UNSHARDING", flatshard::ShardedState::kUnsharding)
      .value("UNSHARDED", flatshard::ShardedState::kUnsharded);

  py::class_<FlatParamHandle>(m, "FlatParamHandle", "One unit's storage: local shard and unsharded buffer.")
      .def(py::init([](std::string name, FlatParamLayout layout, std::int64_t rank,
                       const std::vector<at::Tensor>& params, std::optional<c10::Device> compute_device,
                       std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
                       std::optional<at::ScalarType> grad_dtype, bool offload, double predivide, double postdivide,
                       bool all_reduce_replicas, bool pin_host_memory) {
             flatshard::FlatParamOptions options{compute_device, param_dtype, reduce_dtype, grad_dtype, offload,
                                                 pin_host_memory, predivide, postdivide, all_reduce_replicas};
             return std::make_unique<FlatParamHandle>(std::move(name), std::move(layout), rank, params, options);
           }),
           py::arg("name"), py::arg("layout"), py::arg("rank"), py::arg("params"), py::kw_only(),
           py::arg("compute_device") = py::none(), py::arg("param_dtype") = py::none(),
           py::arg("reduce_dtype") = py::none(), py::arg("grad_dtype") = py::none(), py::arg("offload") = false,
           py::arg("predivide") = 1.0, py::arg("postdivide") = 1.0, py::arg("all_reduce_replicas") = false,
           py::arg("pin_host_memory") = true,
           "See [Note: Mixed precision and offload] in csrc/flatshard/flat_param.h.")
      .def_property("name", &FlatParamHandle::name, &FlatParamHandle::set_name)
      .def_property_readonly("layout", &FlatParamHandle::layout)
      .def_property_readonly("rank", &FlatParamHandle::rank)
      .def_property("group_index", &FlatParamHandle::group_index, &FlatParamHandle::set_group_index)
      .def_property("post_forward_group_index", &FlatParamHandle::post_forward_group_index,
                    &FlatParamHandle::set_post_forward_group_index,
                    "See [Note: Reshard to a smaller group] in csrc/flatshard/flat_param.h; -1: none.")
      .def("has_post_forward_shard", &FlatParamHandle::has_post_forward_shard)
      .def_property("requires_all_reduce", &FlatParamHandle::requires_all_reduce,
                    &FlatParamHandle::set_requires_all_reduce, "See [Note: Reduce-scatter only] in flat_param.h.")
      .def(
          "set_all_reduce_hook",
          [](FlatParamHandle& unit, py::object hook, bool after_postdivide) {
            if (hook.is_none()) {
              unit.set_all_reduce_hook({}, false);
              return;
            }
            // Called with the GIL released (inside the scheduler's calls); the callable is released with the GIL.
            std::shared_ptr<py::object> held(new py::object(std::move(hook)), [](py::object* callable) {
              py::gil_scoped_acquire gil;
              delete callable;
            });
            unit.set_all_reduce_hook(
                [held](const at::Tensor& grad_shard) {
                  py::gil_scoped_acquire gil;
                  (*held)(grad_shard);  // (a Python exception propagates as py::error_already_set)
                },
                after_postdivide);
          },
          py::arg("hook"), py::arg("after_postdivide") = false,
          "See [Note: The all-reduce hook] in flat_param.h; None removes it.")
      .def("set_divide_factors", &FlatParamHandle::set_divide_factors, py::arg("predivide"), py::arg("postdivide"),
           "The gradient's division before and after the SUM from now on (see Scheduler::reduce_grad).")
      .def_property_readonly("local_shard", &FlatParamHandle::local_shard)
      .def("set_local_shard", &FlatParamHandle::set_local_shard, py::arg("param"))
      .def("after_shard_cast", &FlatParamHandle::after_shard_cast)
      .def_property_readonly("unsharded", &FlatParamHandle::unsharded)
      .def_property_readonly("state", &FlatParamHandle::state)
      .def("views", &FlatParamHandle::views)
      .def_property_readonly("placeholder_views", &FlatParamHandle::placeholder_views)
      .def("has_unsharded_storage", &FlatParamHandle::has_unsharded_storage)
      .def_property_readonly("unsharded_nbytes", &FlatParamHandle::unsharded_nbytes)
      .def_property_readonly("is_replicated", &FlatParamHandle::is_replicated)
      .def_property_readonly("has_own_unsharded", &FlatParamHandle::has_own_unsharded)
      .def_property_readonly("compute_device", &FlatParamHandle::compute_device)
      .def_property_readonly("param_dtype", &FlatParamHandle::param_dtype)
      .def_property_readonly("reduce_dtype", &FlatParamHandle::reduce_dtype)
      .def_property_readonly("offload", &FlatParamHandle::offload)
      .def_property_readonly("predivide", &FlatParamHandle::predivide)
      .def_property_readonly("postdivide", &FlatParamHandle::postdivide)
      .def_property_readonly("all_reduce_replicas", &FlatParamHandle::all_reduce_replicas)
      .def_property_readonly(
          "collective_bytes",
          [](const FlatParamHandle& handle) {
            const auto& b = handle.collective_bytes();
            py::dict out;
            out["all_gather"] = b[FlatParamHandle::kGathered];
            out["reduce_scatter"] = b[FlatParamHandle::kReduceScattered];
            out["all_reduce"] = b[FlatParamHandle::kAllReduced];
            out["replica_all_reduce"] = b[FlatParamHandle::kReplicaAllReduced];
            return out;
          },
          "Input bytes of this unit's collectives per kind since the last reset (see [Note: Collective byte "
          "counters]).")
      .def("reset_collective_bytes", &FlatParamHandle::reset_collective_bytes)
      .def(
          "accumulate_grad",
          [](FlatParamHandle& self, const std::vector<std::optional<at::Tensor>>& grads) {
            self.accumulate_grad(undefined_for_none(grads));
          },
          py::arg("grads"))
      .def("has_unsharded_grad", &FlatParamHandle::has_unsharded_grad)
      .def("set_reduce_prefix", &FlatParamHandle::set_reduce_prefix, py::arg("numel"))
      .def_property_readonly("reduce_prefix", &FlatParamHandle::reduce_prefix)
      .def("take_unsharded_grad", &FlatParamHandle::take_unsharded_grad)
      .def("put_back_unsharded_grad", &FlatParamHandle::put_back_unsharded_grad, py::arg("grad"))
      .def("drop_unsharded_grad", &FlatParamHandle::drop_unsharded_grad)
      .def_property_readonly("unsharded_grad", &FlatParamHandle::unsharded_grad);

  py::class_<Scheduler>(m, "Scheduler", "Stream-ordered collectives shared by the units of one root.")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& shard_group,
                       const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& replicate_group,
                       c10::Device device, std::int64_t max_in_flight) {
             std::optional<flatshard::Collectives> replicate;
             if (replicate_group.has_value()) replicate.emplace(*replicate_group);
             return std::make_unique<Scheduler>(flatshard::Collectives(shard_group),
                                                std::move(replicate), device, max_in_flight);
           }),
           py::arg("shard_group"), py::arg("replicate_group"), py::arg("device"),
           py::arg("max_in_flight_all_gathers"))
      .def(
          "add_groups",
          [](Scheduler& self, const c10::intrusive_ptr<c10d::ProcessGroup>& shard_group,
             const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& replicate_group) {
            std::optional<flatshard::Collectives> replicate;
            if (replicate_group.has_value()) replicate.emplace(*replicate_group);
            return self.add_groups(flatshard::Collectives(shard_group), std::move(replicate));
          },
          py::arg("shard_group"), py::arg("replicate_group"))
      .def(
          "set_reduce_scatter_group",
          [](Scheduler& self, std::int64_t index, const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& group) {
            std::optional<flatshard::Collectives> scatter;
            if (group.has_value()) scatter.emplace(*group);
            self.set_reduce_scatter_group(index, std::move(scatter));
          },
          py::arg("index"), py::arg("group"))
      .def_property_readonly("rank", &Scheduler::rank)
      .def_property_readonly("world_size", &Scheduler::world_size)
      .def_property_readonly("has_events", &Scheduler::has_events)
      .def("unshard", &Scheduler::unshard, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      // [Note: One crossing per lifecycle step]
      // The per-unit hot path crosses into C++ once per step of a unit's lifecycle:
      // pre-forward and pre-backward are wait_for_unshard (with the prefetch and the
      // views), post-backward is post_backward (with the reshard and the prefetch),
      // and the reshard after forward is reshard. tests/test_unit_state.py counts them.
      .def(
          "wait_for_unshard",
          [](Scheduler& self, FlatParamHandle& handle, FlatParamHandle* prefetch, bool views) -> py::object {
            {
              py::gil_scoped_release no_gil;
              self.wait_for_unshard(handle);
              if (prefetch != nullptr) self.unshard(*prefetch);
            }
            if (!views) return py::none();
            return py::cast(handle.views());
          },
          py::arg("handle"), py::arg("prefetch") = nullptr, py::arg("views") = false,
          "Waits for `handle`'s all-gather (issuing it first if needed), then issues `prefetch`'s (a no-op "
          "unless it is sharded); returns the unit's views of its unsharded buffer with `views`, else None.")
      .def("reshard", &Scheduler::reshard, py::arg("handle"), py::arg("after_forward") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_grad", &Scheduler::reduce_grad, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def(
          "post_backward",
          [](Scheduler& self, FlatParamHandle& handle, const std::vector<std::optional<at::Tensor>>& grads, bool reduce,
             bool uses_done, bool reshard, FlatParamHandle* prefetch) {
            std::vector<at::Tensor> defined = undefined_for_none(grads);
            py::gil_scoped_release no_gil;
            self.post_backward(handle, defined, reduce, uses_done, reshard);
            if (prefetch != nullptr) self.unshard(*prefetch);
          },
          py::arg("handle"), py::arg("grads"), py::arg("reduce"), py::arg("uses_done"), py::arg("reshard"),
          py::arg("prefetch") = nullptr,
          "Scheduler::post_backward, then issues `prefetch`'s all-gather (a no-op unless it is sharded).")
      .def("unshard_together", &Scheduler::unshard_together, py::arg("handles"),
           py::call_guard<py::gil_scoped_release>())
      .def_property("coalesce_bytes", &Scheduler::coalesce_bytes, &Scheduler::set_coalesce_bytes)
      .def(
          "count_sharded",
          [](const Scheduler&, const std::vector<FlatParamHandle*>& handles) {
            std::int64_t n = 0;
            for (const FlatParamHandle* handle : handles) n += handle->state() == flatshard::ShardedState::kSharded;
            return n;
          },
          py::arg("handles"), "How many of `handles` are sharded (one crossing for the whole list).")
      .def("gather_full_precision", &Scheduler::gather_full_precision, py::arg("handle"),
           py::call_guard<py::gil_scoped_release>())
      .def("accumulate_reduced_grad", &Scheduler::accumulate_reduced_grad, py::arg("handle"), py::arg("grad_shard"),
           py::call_guard<py::gil_scoped_release>())
      .def("finish_grad_sync", &Scheduler::finish_grad_sync, py::call_guard<py::gil_scoped_release>())
      .def("complete_issued_reductions", &Scheduler::complete_issued_reductions,
           py::call_guard<py::gil_scoped_release>())
      .def("reduction_deferred", &Scheduler::reduction_deferred, py::arg("handle"))
      .def("abort_grad_sync", &Scheduler::abort_grad_sync, py::call_guard<py::gil_scoped_release>())
      .def("set_sequence_check", &Scheduler::set_sequence_check, py::arg("on"))
      .def("drain", &Scheduler::drain, py::arg("timeout_seconds"), py::call_guard<py::gil_scoped_release>())
      .def_property("max_reductions_in_flight", &Scheduler::max_reductions_in_flight,
                    &Scheduler::set_max_reductions_in_flight)
      .def_property_readonly("pending_reductions", &Scheduler::pending_reductions)
      .def_property_readonly("pending_all_gathers", &Scheduler::pending_all_gathers)
      .def_property_readonly("limiter_stalls",
                             [](const Scheduler& s) { return s.limiter().stalls(); });

  // The one error type of the rank-divergence guard, raised by Python's checks and by the strict
  // sequence check here (flatshard.RankDivergenceError is this class).
  py::register_exception<flatshard::RankDivergence>(m, "RankDivergenceError", PyExc_RuntimeError);
  // See flatshard::PeerGone (flatshard.PeerGoneError): not a RankDivergenceError.
  py::register_exception<flatshard::PeerGone>(m, "PeerGoneError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const flatshard::Interrupted& e) {
      PyErr_SetNone(e.exit() ? PyExc_SystemExit : PyExc_KeyboardInterrupt);
    }
  });
  m.def("unsharded_bytes", &flatshard::MemoryCounter::unsharded_bytes,
        "Bytes of unsharded buffers alive in this process.");
  m.def("peak_unsharded_bytes", &flatshard::MemoryCounter::peak_unsharded_bytes,
        "Peak of unsharded_bytes() since the last reset_peak_unsharded_bytes().");
  m.def("reset_peak_unsharded_bytes", &flatshard::MemoryCounter::reset_peak);
  // See [Note: Collective byte counters].
  m.def(
      "collective_counts",
      []() {
        static const char* kinds[] = {"all_gather", "reduce_scatter", "all_reduce"};
        py::dict out;
        for (const auto& [group, counts] : flatshard::collective_counts()) {
          py::dict per_kind;
          for (int k = 0; k < flatshard::kCollectiveKinds; ++k) {
            per_kind[kinds[k]] = py::make_tuple(counts[k].calls, counts[k].bytes);
          }
          out[py::str(group)] = per_kind;
        }
        return out;
      },
      "{process group name: {kind: (calls, input bytes)}} of the runtime's collectives since the last reset.");
  m.def("reset_collective_counts", &flatshard::reset_collective_counts);
  // See [Note: Stalled waits]. The callable is held for the life of the process (a wait may still run
  // during interpreter exit, when a Python object could no longer be released).
  m.def(
      "set_stall_hook",
      [](py::object hook, double first_seconds, double every_seconds) {
        if (hook.is_none()) {
          flatshard::set_stall_hook({}, 0, 0);
          return;
        }
        auto* held = new py::object(std::move(hook));
        flatshard::set_stall_hook(
            [held](const std::string& what, double waited, const std::string& error) -> flatshard::StallVerdict {
              py::gil_scoped_acquire gil;
              try {
                // The hook answers (verdict, peer_gone); "" for no verdict.
                auto answer = (*held)(what, waited, error).cast<std::pair<std::string, bool>>();
                return {answer.first, answer.second};
              } catch (py::error_already_set& e) {
                // Ctrl-C (or sys.exit) while a wait stalls: it ends the wait, as it would any Python wait.
                if (e.matches(PyExc_KeyboardInterrupt)) throw flatshard::Interrupted(false);
                if (e.matches(PyExc_SystemExit)) throw flatshard::Interrupted(true);
                e.discard_as_unraisable("flatshard's stall hook");
                return {};
              }
            },
            first_seconds, every_seconds);
      },
      py::arg("hook"), py::arg("first_seconds") = 1.0, py::arg("every_seconds") = 0.5,
      "hook(what, waited_seconds, error) -> '' to keep waiting (or, for a failed wait, its error), else the error to "
      "raise (see [Note: Stalled waits]); None: off.");
}
