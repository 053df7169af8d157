// A type carried as a value: what a runtime switch (access width, element
// type) passes to a generic lambda, once per case, so that one switch
// instantiates a kernel's launch for every type. In the lambda:
//   [&](auto tag) { using T = typename decltype(tag)::type; ... }
#pragma once

namespace pk {

template <typename T>
struct TypeTag {
  using type = T;
};

}  // namespace pk
