// Empty stand-in: tests/simt/simt.h defines what CUDA code uses from cuda_fp16.h.
#pragma once
