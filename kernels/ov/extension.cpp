// The library's entry points: OpenVINO's create_extensions (core.add_extension(path)) and two C functions
// that say which build and instruction set this is (fleet_common/kernels.py checks them).
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>

#include "../core/product.h"
#include "gguf_embedding.h"
#include "gguf_matmul.h"
#include "gguf_moe_matmul.h"
#include "gguf_sparse_ffn.h"

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<fleet::GgufMatMul>>(),
    std::make_shared<ov::OpExtension<fleet::GgufEmbedding>>(),
    std::make_shared<ov::OpExtension<fleet::GgufMoeMatMul>>(),
    std::make_shared<ov::OpExtension<fleet::GgufSparseFfn>>(),
}));

extern "C" __attribute__((visibility("default"))) const char* fleet_kernels_version() { return FLEET_KERNELS_VERSION; }

extern "C" __attribute__((visibility("default"))) const char* fleet_kernels_isa() {
    try {
        return fleet::active_kernels().isa;
    } catch (const std::exception&) {
        return "";
    }
}
