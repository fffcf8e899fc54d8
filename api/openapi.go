package api

import (
	_ "embed" // the OpenAPI document
	"net/http"

	"github.com/gin-gonic/gin"
)

// openapiJSON is the OpenAPI 3.1 document of every route (CONTRACT §12).
// It is written by hand: the handlers' request types carry none of the
// rules (identifier patterns, ranges, which problem codes each answer can
// hold) that make the document worth reading, and the package's tests
// check every request and answer they exchange against it, so it cannot
// drift from the code unnoticed.
//
//go:embed openapi.json
var openapiJSON []byte

// openapi serves the document. It needs no token: it says nothing about
// anyone's devices.
func (s *Server) openapi(c *gin.Context) {
	c.Data(http.StatusOK, "application/json; charset=utf-8", openapiJSON)
}
