#pragma once
// Minimal HDF5 reading for test fixtures (tests/reference/*.h5).
#include <hdf5.h>

#include <string>
#include <vector>

#include "autograd/tensor.h"

namespace kvlab::testing {

class H5Fixture {
 public:
  explicit H5Fixture(const std::string& path) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    KVLAB_CHECK(file_ >= 0, "fixture ", path, ": cannot open (run tests/reference/make_fixtures.py)");
  }
  ~H5Fixture() {
    if (file_ >= 0) H5Fclose(file_);
  }
  H5Fixture(const H5Fixture&) = delete;
  H5Fixture& operator=(const H5Fixture&) = delete;

  bool has(const std::string& path) const { return H5Lexists(file_, path.c_str(), H5P_DEFAULT) > 0; }

  Tensor read(const std::string& path, DType dtype = DType::F32) const {
    hid_t ds = H5Dopen2(file_, path.c_str(), H5P_DEFAULT);
    KVLAB_CHECK(ds >= 0, "fixture: no dataset ", path);
    hid_t space = H5Dget_space(ds);
    const int nd = H5Sget_simple_extent_ndims(space);
    std::vector<hsize_t> dims(nd);
    H5Sget_simple_extent_dims(space, dims.data(), nullptr);
    Shape shape(dims.begin(), dims.end());
    Tensor t = Tensor::empty(shape, dtype);
    const hid_t mem = dtype == DType::I32   ? H5T_NATIVE_INT32
                      : dtype == DType::F64 ? H5T_NATIVE_DOUBLE
                                            : H5T_NATIVE_FLOAT;
    const herr_t rc = H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw_data());
    H5Sclose(space);
    H5Dclose(ds);
    KVLAB_CHECK(rc >= 0, "fixture: cannot read ", path);
    return t;
  }

  int64_t attr_int(const std::string& name) const {
    int64_t v = 0;
    hid_t a = H5Aopen(file_, name.c_str(), H5P_DEFAULT);
    KVLAB_CHECK(a >= 0, "fixture: no attribute ", name);
    H5Aread(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    return v;
  }
  double attr_double(const std::string& name) const {
    double v = 0;
    hid_t a = H5Aopen(file_, name.c_str(), H5P_DEFAULT);
    KVLAB_CHECK(a >= 0, "fixture: no attribute ", name);
    H5Aread(a, H5T_NATIVE_DOUBLE, &v);
    H5Aclose(a);
    return v;
  }
  bool has_attr(const std::string& name) const { return H5Aexists(file_, name.c_str()) > 0; }
  // A fixed-length string attribute (numpy bytes), without trailing NULs.
  std::string attr_string(const std::string& name) const {
    hid_t a = H5Aopen(file_, name.c_str(), H5P_DEFAULT);
    KVLAB_CHECK(a >= 0, "fixture: no attribute ", name);
    const hid_t type = H5Aget_type(a);
    std::string v(H5Tget_size(type), '\0');
    const herr_t rc = H5Aread(a, type, v.data());
    H5Tclose(type);
    H5Aclose(a);
    KVLAB_CHECK(rc >= 0, "fixture: cannot read attribute ", name);
    return v.substr(0, v.find('\0'));
  }

 private:
  hid_t file_ = -1;
};

}  // namespace kvlab::testing
