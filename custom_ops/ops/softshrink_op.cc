// Registration of TfmetalExt>Softshrink and its gradient op.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfmetalExt>Softshrink")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("lambd: float = 0.5")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Softshrink: y = x - lambd where x > lambd, x + lambd where x < -lambd, else 0.
NaN propagates. lambd must be >= 0.
)doc");

REGISTER_OP("TfmetalExt>SoftshrinkGrad")
    .Input("dy: T")
    .Input("x: T")
    .Output("dx: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("lambd: float = 0.5")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle merged;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &merged));
      c->set_output(0, merged);
      return Status();
    })
    .Doc("Gradient of TfmetalExt>Softshrink: dx = dy where |x| > lambd, else 0.");

}  // namespace tfmetal_ext
